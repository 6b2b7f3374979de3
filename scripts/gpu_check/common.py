"""Shared by the gpu-check task scripts (scripts/gpu-check.sh): which framework the
machine's Python has, and writing a task's findings as one JSON file into the directory
the script gave every task (GPU_CHECK_OUT), atomically, so the script never reads half."""

import json
import os
import sys

# JAX grabs 75% of GPU memory at start by default: two shares of one GPU would not fit.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def framework():
    """('torch', module) when PyTorch imports, else ('jax', module), else (None, reason)."""
    errors = []
    try:
        import torch  # noqa: PLC0415

        return "torch", torch
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        errors.append(f"torch: {type(e).__name__}: {e}")
    try:
        import jax  # noqa: PLC0415

        return "jax", jax
    except Exception as e:  # noqa: BLE001
        errors.append(f"jax: {type(e).__name__}: {e}")
    return None, "; ".join(errors)


def jax_gpus(jax):
    """The GPU devices JAX sees (empty when it has only the CPU)."""
    try:
        return [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
    except Exception:  # noqa: BLE001 - no GPU backend
        return []


def write_result(name, result):
    """Writes `result` to $GPU_CHECK_OUT/<name>.json and prints it."""
    out = os.environ.get("GPU_CHECK_OUT", ".")
    path = os.path.join(out, f"{name}.json")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    json.dump(result, sys.stdout, indent=1, sort_keys=True)
    print()


def base_facts():
    """What every task records about where it runs."""
    return {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "python": sys.executable,
        "python_version": sys.version.split()[0],
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "NVIDIA_VISIBLE_DEVICES": os.environ.get("NVIDIA_VISIBLE_DEVICES"),
        "GPUAM_GPU_MASK": os.environ.get("GPUAM_GPU_MASK"),
        "GPUAM_GPU_FRACTION": os.environ.get("GPUAM_GPU_FRACTION"),
        "GPUAM_CONTAINER_ID": os.environ.get("GPUAM_CONTAINER_ID"),
    }
