"""gpu-check, run as root by scripts/gpu-check.sh: turns what a step left behind into the
report's lines. Each command prints `PASS name: ...`, `FAIL name: ...` or `SEEN name: ...`
lines (the script copies those into the summary), then details; it exits 0 when its
PASS/FAIL lines all passed, 1 otherwise.

  verdicts.py registration HOST NODES_JSON QUERY_CSV TOPO_TXT
  verdicts.py train TRAIN_JSON
  verdicts.py no_gpu NO_GPU_JSON
  verdicts.py shares OUT_DIR SAMPLES_TXT
  verdicts.py health HEALTH_JSON
  verdicts.py python     (one line: this Python's version and its torch / jax / pynvml)
"""

import json
import os
import re
import sys

ok = True


def line(kind, name, text):
    global ok
    if kind == "FAIL":
        ok = False
    print(f"{kind} {name}: {text}")


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"_missing": f"{path}: {e}"}


def topo_gpus(text):
    """The GPU columns of a `nvidia-smi topo -m` header line (0 when there is none)."""
    for raw in text.splitlines():
        toks = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", raw).split()
        if toks and toks[0] == "GPU0" and (len(toks) < 2 or toks[1] != "X"):
            return sum(1 for t in toks if re.fullmatch(r"GPU\d+", t))
    return 0


def registration(host, nodes_json, query_csv, topo_txt):
    smi = []
    with open(query_csv, encoding="utf-8") as f:
        for row in f:
            cells = [c.strip() for c in row.split(",")]
            if len(cells) >= 2 and cells[0].isdigit():
                smi.append(cells)
    try:
        with open(topo_txt, encoding="utf-8") as f:
            topo = f.read()
    except OSError:
        topo = ""
    nodes = load(nodes_json).get("nodes", {}).get("node", [])
    node = next((n for n in nodes if n.get("nodeHostName") == host), None)
    if node is None:
        line("FAIL", "registration", f"node `{host}` is not in the RM's node listing ({len(nodes)} nodes)")
        return
    res = {r["name"]: r["value"] for r in node["totalResource"]["resourceInformations"]["resourceInformation"]}
    gpus = res.get("yarn.io/gpu", 0)
    gtype = node.get("gpuType") or ""
    reg_topo = topo_gpus(node.get("gpuTopology") or "")
    print(f"{'':24}{'gpuam node (RM listing)':34}nvidia-smi")
    print(f"{'GPU count':24}{gpus!s:34}{len(smi)}")
    names = sorted({c[1] for c in smi})
    print(f"{'GPU type':24}{gtype:34}{', '.join(names)}")
    mem = sorted({c[2] for c in smi if len(c) > 2})
    print(f"{'memory':24}{str(res.get('memory-mb')) + ' MB host (no GPU memory)':34}{', '.join(mem)} per GPU")
    print(f"{'GPU mask':24}{node.get('gpuAttribute')!s:34}indices {', '.join(c[0] for c in smi)}")
    print(f"{'topology (GPU columns)':24}{reg_topo!s:34}{topo_gpus(topo)}")
    print(f"{'state':24}{node.get('state')!s:34}")
    if gpus == len(smi) and len(smi) > 0:
        line("PASS", "registration.count", f"the node registered {gpus} GPUs, nvidia-smi lists {len(smi)}")
    else:
        line("FAIL", "registration.count", f"the node registered {gpus} GPUs, nvidia-smi lists {len(smi)}")
    words = {w for n in names for w in re.split(r"[\s-]+", n)}
    if gtype and gtype in words:
        line("PASS", "registration.type", f"gpuType `{gtype}` is a word of `{', '.join(names)}`")
    else:
        line("FAIL", "registration.type", f"gpuType `{gtype}` is not a word of `{', '.join(names)}`")
    if topo_gpus(topo) == 0:
        line("SEEN", "registration.topology", "nvidia-smi topo -m printed no matrix; the node has no topology")
    elif reg_topo == topo_gpus(topo):
        line("PASS", "registration.topology", f"the node's topology has the {reg_topo} GPU columns of nvidia-smi topo -m")
    else:
        line("FAIL", "registration.topology", f"the node's topology has {reg_topo} GPU columns, nvidia-smi topo -m {topo_gpus(topo)}")
    print("registered topology text:")
    print(node.get("gpuTopology") or "(none)")


def train(path):
    r = load(path)
    if "_missing" in r:
        line("FAIL", "train", f"the task wrote no result ({r['_missing']})")
        return
    dev = r.get("device")
    if r.get("CUDA_VISIBLE_DEVICES") == "0" and dev and ("cuda" in dev.lower() or "gpu" in dev.lower()) and "error" not in r:
        line(
            "PASS",
            "train",
            f"{r['framework']} trained on {dev} ({r.get('gpu_name')}), CUDA_VISIBLE_DEVICES=0: "
            f"{r.get('gpu_step_ms')} ms/step on the GPU, {r.get('cpu_step_ms')} ms/step on the CPU "
            f"({r.get('cpu_over_gpu')}x), {r['shape']}",
        )
    else:
        why = r.get("error") or f"device {dev!r}, {r.get('gpus_visible')} GPUs visible"
        line(
            "FAIL",
            "train",
            f"no training step on granted GPU 0 (CUDA_VISIBLE_DEVICES={r.get('CUDA_VISIBLE_DEVICES')!r}, "
            f"framework {r.get('framework')}): {why}; CPU step {r.get('cpu_step_ms')} ms",
        )
    also = r.get("also")
    if also:
        if also.get("device"):
            line(
                "SEEN",
                "train.also",
                f"{also['framework']} too, on {also['device']} ({also.get('gpu_name')}): "
                f"{also.get('gpu_step_ms')} ms/step on the GPU, {also.get('cpu_step_ms')} ms/step on the CPU",
            )
        else:
            why = also.get("error") or f"{also.get('gpus_visible')} GPUs visible"
            line("SEEN", "train.also", f"{also.get('framework')} did not train on a GPU: {why}")
    if r.get("uid") == 0:
        line("FAIL", "train.user", "the task ran as root")
    print(json.dumps(r, indent=1, sort_keys=True))


def no_gpu(path):
    r = load(path)
    if "_missing" in r:
        line("FAIL", "no_gpu.ran", f"the task wrote no result ({r['_missing']})")
        return
    granted = (r.get("granted_CUDA_VISIBLE_DEVICES"), r.get("granted_NVIDIA_VISIBLE_DEVICES"))
    if granted == ("", "none"):
        line("PASS", "no_gpu.env", "the task was given CUDA_VISIBLE_DEVICES='' and NVIDIA_VISIBLE_DEVICES=none")
    else:
        line("FAIL", "no_gpu.env", f"the task was given CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES = {granted}")
    opened = ", ".join(f"{k}: {v}" for k, v in r.get("open", {}).items())
    what = {
        "REACHED": f"it computed on a GPU anyway ({r.get('computed')}): the node does not isolate devices",
        "OPENED": "it opened NVIDIA device files but computed on no GPU",
        "BLOCKED": "it could neither open an NVIDIA device file nor compute on a GPU",
    }[r["verdict"]]
    line("SEEN", "no_gpu.isolation", f"{r['verdict']}: {what}; {opened}; framework {r.get('framework')}")
    print(json.dumps(r, indent=1, sort_keys=True))


def shares(out_dir, samples_txt):
    rs = [load(os.path.join(out_dir, f"share-{i}.json")) for i in (0, 1)]
    missing = [r["_missing"] for r in rs if "_missing" in r]
    if missing:
        line("FAIL", "shares", f"a share task wrote no result: {'; '.join(missing)}")
        return
    both_gpu0 = all(r.get("CUDA_VISIBLE_DEVICES") == "0" and r.get("GPUAM_GPU_FRACTION") == "0.5" for r in rs)
    overlap = min(r["hold_end"] for r in rs) - max(r["hold_start"] for r in rs)
    on_gpu = all(r.get("on_gpu") for r in rs)
    desc = ", ".join(
        f"task {r['task_index']} pid {r['pid']} CUDA_VISIBLE_DEVICES={r.get('CUDA_VISIBLE_DEVICES')} "
        f"fraction {r.get('GPUAM_GPU_FRACTION')} on_gpu {r.get('on_gpu')} ({r.get('gpu_steps')} matmuls)"
        for r in rs
    )
    if both_gpu0 and overlap > 0:
        line("PASS", "shares.granted", f"both tasks were granted 0.5 of GPU 0 and ran at once for {overlap:.1f} s: {desc}")
    else:
        line("FAIL", "shares.granted", f"not two 0.5 shares of GPU 0 at once (overlap {overlap:.1f} s): {desc}")
    if on_gpu and overlap > 0:
        line("PASS", "shares.on_gpu", f"both computed on the GPU during the {overlap:.1f} s they overlapped")
    else:
        line("FAIL", "shares.on_gpu", "not both tasks computed on the GPU: " + "; ".join(r.get("error") or f"framework {r.get('framework')}" for r in rs))
    pids = {str(r["pid"]) for r in rs}
    best = 0
    seen_pids = set()
    try:
        with open(samples_txt, encoding="utf-8") as f:
            samples = f.read().split("--- sample")
    except OSError:
        samples = []
    for s in samples:
        apps = {m.group(1) for m in re.finditer(r"^\s*(\d+)\s*,", s, re.M)}
        best = max(best, len(apps))
        if pids <= apps:
            seen_pids = apps
    if seen_pids:
        line("PASS", "shares.compute_apps", f"one nvidia-smi --query-compute-apps sample lists both task pids {sorted(pids)}")
    else:
        line(
            "SEEN",
            "shares.compute_apps",
            f"no sample lists both task pids {sorted(pids)} (most GPU processes in one sample: {best}; "
            "inside a container nvidia-smi may show host pids or none)",
        )


def health(path):
    r = load(path)
    if "_missing" in r or not r.get("gpus"):
        line("FAIL", "health", f"no health read: {r.get('_missing') or r.get('error')}")
        return
    for g in r["gpus"]:
        kind = "PASS" if g["healthy"] else "FAIL"
        line(
            kind,
            f"health.gpu{g['index']}",
            f"{g['name']}: {g['temperature_c']} C, ECC {'on' if g['ecc_enabled'] else 'off/unknown'}, "
            f"volatile uncorrected {g['ecc_volatile_uncorrected']}, remapped rows {g.get('remapped_rows')}, "
            f"{g['power_w']} W of {g['power_limit_w']} W, pstate {g['pstate']}"
            + ("" if g["healthy"] else f"; problems: {'; '.join(g['problems'])}"),
        )
    print(json.dumps(r, indent=1))


def python():
    out = [f"Python {sys.version.split()[0]}"]
    for m in ("torch", "jax", "pynvml"):
        try:
            mod = __import__(m)
            out.append(f"{m} {getattr(mod, '__version__', '?')}")
        except Exception:  # noqa: BLE001 - any failure means "not usable"
            out.append(f"no {m}")
    print(", ".join(out))


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    {"registration": registration, "train": train, "no_gpu": no_gpu, "shares": shares, "health": health, "python": python}[cmd](*args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
