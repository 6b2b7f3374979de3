"""gpu-check task granted no GPU that tries to use one anyway: it clears
CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES (which gpuam set to "" / "none"), opens the
NVIDIA device files directly, runs `nvidia-smi -L`, and asks PyTorch (else JAX) for a GPU
and computes on it. Writes $GPU_CHECK_OUT/no_gpu.json with a verdict:
REACHED (it computed on a GPU), OPENED (a device file opened, no computation),
BLOCKED (nothing)."""

import glob
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
res = {
    "granted_CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "granted_NVIDIA_VISIBLE_DEVICES": os.environ.get("NVIDIA_VISIBLE_DEVICES"),
}
# Before any framework import: what an escaping task would do.
os.environ.pop("CUDA_VISIBLE_DEVICES", None)
os.environ.pop("NVIDIA_VISIBLE_DEVICES", None)
import common  # noqa: E402

res.update(common.base_facts())
res["device_files"] = sorted(glob.glob("/dev/nvidia*"))
opened = {}
for path in ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"]:
    try:
        fd = os.open(path, os.O_RDWR)
        os.close(fd)
        opened[path] = "opened"
    except OSError as e:
        opened[path] = f"{type(e).__name__}: {e.strerror} (errno {e.errno})"
res["open"] = opened
try:
    p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    res["nvidia_smi_L"] = {"rc": p.returncode, "out": (p.stdout + p.stderr).strip()[-500:]}
except (OSError, subprocess.SubprocessError) as e:
    res["nvidia_smi_L"] = {"rc": None, "out": f"{type(e).__name__}: {e}"}

computed = False
name, fw = common.framework()
res["framework"] = f"{name} {fw.__version__}" if name else None
try:
    if name == "torch":
        res["cuda_available"] = fw.cuda.is_available()
        res["device_count"] = fw.cuda.device_count()
        if res["cuda_available"]:
            v = fw.ones(1024, device="cuda:0").sum().item()
            res["computed"] = f"sum on cuda:0 ({fw.cuda.get_device_name(0)}) = {v}"
            computed = True
    elif name == "jax":
        gpus = common.jax_gpus(fw)
        res["jax_devices"] = [str(d) for d in fw.devices()]
        if gpus:
            import jax.numpy as jnp  # noqa: PLC0415

            v = float(fw.device_put(jnp.ones(1024), gpus[0]).sum())
            res["computed"] = f"sum on {gpus[0]} = {v}"
            computed = True
except Exception as e:  # noqa: BLE001 - a refusal is what isolation should give
    res["framework_error"] = f"{type(e).__name__}: {e}"[:500]
if computed:
    res["verdict"] = "REACHED"
elif any(v == "opened" for v in opened.values()):
    res["verdict"] = "OPENED"
else:
    res["verdict"] = "BLOCKED"
common.write_result("no_gpu", res)
