"""Launch-rate measurement on a running Ray cluster (run by scripts/ray-launch-bench.sh).

Compares, for N one-GPU tasks pinned with gpuam's resources (`gpuam-node-<host>`,
`gpuam-gpu-<i>`), the time from the first submit to the last task running:
  jobs: one Ray job per task through the Jobs REST API (what `gpuam rm --backend ray` does);
  pg:   one long-lived driver (this process) creating one STRICT_PACK placement group per task
        and running the task in it (the alternative the issue names), cold and then warm.
  gang: one placement group of N bundles (PACK) for N tasks, SHARE tasks per GPU (a gang of
        GPU shares), cold and then warm.
Prints one line per mode. Usage: ray-launch-bench.py N HOSTS GPUS REC [MODES] where MODES is
`all` (default: jobs, pg) , `pg` (pg cold and warm only) or `gang:SHARE` (gang cold and warm).
"""
import json
import os
import sys
import time
import urllib.request

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

N = int(sys.argv[1])
HOSTS = sys.argv[2].split(",")
GPUS = int(sys.argv[3])
DASH = "http://127.0.0.1:8265"
REC = sys.argv[4]


def slots():
    """(host, gpu) pairs, host by host."""
    return [(h, g) for h in HOSTS for g in range(GPUS)][:N]


def jobs_mode(tag):
    open(REC, "w").close()
    t0 = time.time()
    for i, (h, g) in enumerate(slots()):
        body = {
            "entrypoint": f"echo $(date +%s.%N) >> {REC}; sleep 3",
            "submission_id": f"bench-{tag}-{os.getpid()}-{i}",
            "entrypoint_num_cpus": 0,
            "entrypoint_num_gpus": 0,
            "entrypoint_resources": {f"gpuam-node-{h}": 0.001, f"gpuam-gpu-{g}": 1},
            "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": str(g)}},
        }
        req = urllib.request.Request(DASH + "/api/jobs/", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=60).read()
    submitted = time.time() - t0
    while True:
        with open(REC) as f:
            lines = f.read().split()
        if len(lines) >= N:
            break
        time.sleep(0.05)
    last = max(float(x) for x in lines) - t0
    print(f"jobs: {N} Ray jobs: submits took {submitted:.2f} s, all running after {last:.2f} s")
    # Let them end, so the GPUs are free for the next mode.
    time.sleep(4)


@ray.remote(num_cpus=0)
def task(gpu):
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    started = time.time()
    time.sleep(3)
    return started


def pg_mode(label):
    t0 = time.time()
    pgs, refs = [], []
    for h, g in slots():
        pg = placement_group([{f"gpuam-node-{h}": 0.001, f"gpuam-gpu-{g}": 1}], strategy="STRICT_PACK")
        pgs.append(pg)
        refs.append(task.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg),
            resources={f"gpuam-gpu-{g}": 1, f"gpuam-node-{h}": 0.001},
            name=f"bench-{label}-{h}-{g}",
        ).remote(g))
    starts = ray.get(refs)
    print(f"pg ({label}): {N} placement groups + tasks: all running after {max(starts) - t0:.2f} s")
    for pg in pgs:
        remove_placement_group(pg)
    time.sleep(1)


def gang_mode(label, share):
    slots = [(h, g) for h in HOSTS for g in range(GPUS) for _ in range(share)][:N]
    t0 = time.time()
    pg = placement_group([{f"gpuam-node-{h}": 0.001, f"gpuam-gpu-{g}": 1.0 / share} for h, g in slots],
                         strategy="PACK")
    refs = [task.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
        resources={f"gpuam-gpu-{g}": 1.0 / share, f"gpuam-node-{h}": 0.001},
    ).remote(g) for i, (h, g) in enumerate(slots)]
    starts = ray.get(refs)
    print(f"gang ({label}): one placement group of {N} bundles + {N} tasks: all running after {max(starts) - t0:.2f} s")
    remove_placement_group(pg)
    time.sleep(1)


if __name__ == "__main__":
    modes = sys.argv[5] if len(sys.argv) > 5 else "all"
    if modes == "all":
        jobs_mode("a")
    ray.init(address="auto", logging_level="ERROR")
    if modes.startswith("gang:"):
        gang_mode("cold", int(modes.split(":")[1]))
        gang_mode("warm", int(modes.split(":")[1]))
    else:
        pg_mode("cold")
        pg_mode("warm")
