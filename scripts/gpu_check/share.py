"""gpu-check task holding a GPU share: it records when it starts, waits (up to 60 s) until
the other share task has started too, then computes on its GPU (matmuls on ~1 GiB it
allocated) for HOLD seconds, so that both tasks are on the GPU at the same time while
gpu-check.sh samples `nvidia-smi --query-compute-apps`. Without a GPU framework it only
holds the time (on_gpu false). Writes $GPU_CHECK_OUT/share-<task index>.json."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HOLD = float(os.environ.get("GPU_CHECK_HOLD_SEC", "8"))
out = os.environ.get("GPU_CHECK_OUT", ".")
me = os.environ.get("GPUAM_TASK_INDEX", "0")
peer = "1" if me == "0" else "0"
res = common.base_facts()
res["task_index"] = me
name, fw = common.framework()
res["framework"] = f"{name} {fw.__version__}" if name else None
res["on_gpu"] = False
work = None
try:
    if name == "torch" and fw.cuda.is_available():
        block = fw.empty(256 << 20, dtype=fw.float32, device="cuda:0")  # 1 GiB
        a = fw.randn(2048, 2048, device="cuda:0")
        fw.cuda.synchronize()
        res["gpu_name"] = fw.cuda.get_device_name(0)

        def work():
            b = a @ a
            fw.cuda.synchronize()
            return float(b[0, 0])
    elif name == "jax" and common.jax_gpus(fw):
        import jax.numpy as jnp  # noqa: PLC0415

        dev = common.jax_gpus(fw)[0]
        block = fw.device_put(jnp.zeros(256 << 20, dtype=jnp.float32), dev)
        a = fw.device_put(jnp.ones((2048, 2048)), dev)
        res["gpu_name"] = dev.device_kind

        def work():
            return float((a @ a)[0, 0])
except Exception as e:  # noqa: BLE001
    res["error"] = f"{type(e).__name__}: {e}"[:500]
    work = None
open(os.path.join(out, f"share-{me}.started"), "w").close()
deadline = time.time() + 60
while not os.path.exists(os.path.join(out, f"share-{peer}.started")) and time.time() < deadline:
    time.sleep(0.1)
res["peer_started"] = os.path.exists(os.path.join(out, f"share-{peer}.started"))
res["hold_start"] = time.time()
steps = 0
while time.time() < res["hold_start"] + HOLD:
    if work is None:
        time.sleep(0.2)
    else:
        work()
        steps += 1
res["hold_end"] = time.time()
res["gpu_steps"] = steps
res["on_gpu"] = work is not None and steps > 0
common.write_result(f"share-{me}", res)
