"""gpu-check, run as root: each GPU's health through NVIDIA's management library (NVML,
the `pynvml` module of the nvidia-ml-py package): temperature, ECC mode and error counts,
remapped rows, retired pages pending, power, performance state and clock event reasons.
Prints one JSON object; exits 3 when pynvml does not import (gpu-check.sh then reads the
same through `nvidia-smi -q`). Every field that a GPU does not support is `null` with
the NVML error beside it."""

import json
import sys

try:
    import pynvml
except Exception as e:  # noqa: BLE001
    print(json.dumps({"source": None, "error": f"pynvml does not import: {e}"}))
    sys.exit(3)


def get(errors, key, fn, *args):
    try:
        v = fn(*args)
        return v.decode() if isinstance(v, bytes) else v
    except Exception as e:  # noqa: BLE001 - NVMLError, or a function this pynvml lacks
        errors[key] = f"{type(e).__name__}: {e}"
        return None


def main():
    pynvml.nvmlInit()
    try:
        out = {
            "source": f"NVML through pynvml (nvidia-ml-py {getattr(pynvml, '__version__', '?')})",
            "driver": get({}, "driver", pynvml.nvmlSystemGetDriverVersion),
            "gpus": [],
        }
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            errs = {}
            g = {"index": i, "name": get(errs, "name", pynvml.nvmlDeviceGetName, h)}
            g["uuid"] = get(errs, "uuid", pynvml.nvmlDeviceGetUUID, h)
            g["temperature_c"] = get(errs, "temperature_c", pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
            mode = get(errs, "ecc_mode", pynvml.nvmlDeviceGetEccMode, h)
            g["ecc_enabled"] = None if mode is None else bool(mode[0])
            for kind, counter in [("volatile", pynvml.NVML_VOLATILE_ECC), ("aggregate", pynvml.NVML_AGGREGATE_ECC)]:
                for err, etype in [("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED), ("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)]:
                    key = f"ecc_{kind}_{err}"
                    g[key] = get(errs, key, pynvml.nvmlDeviceGetTotalEccErrors, h, etype, counter)
            rows = get(errs, "remapped_rows", pynvml.nvmlDeviceGetRemappedRows, h)
            if rows is not None:
                g["remapped_rows"] = {"corrected": rows[0], "uncorrected": rows[1], "pending": bool(rows[2]), "failed": bool(rows[3])}
            pend = get(errs, "retired_pages_pending", pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
            g["retired_pages_pending"] = None if pend is None else bool(pend)
            mw = get(errs, "power_w", pynvml.nvmlDeviceGetPowerUsage, h)
            g["power_w"] = None if mw is None else mw / 1000
            lim = get(errs, "power_limit_w", pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
            g["power_limit_w"] = None if lim is None else lim / 1000
            g["pstate"] = get(errs, "pstate", pynvml.nvmlDeviceGetPerformanceState, h)
            reasons_fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
                pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
            )
            reasons = get(errs, "clock_event_reasons", reasons_fn, h)
            g["clock_event_reasons"] = None if reasons is None else hex(reasons)
            mem = get(errs, "memory", pynvml.nvmlDeviceGetMemoryInfo, h)
            if mem is not None:
                g["memory_total_mib"] = mem.total >> 20
                g["memory_used_mib"] = mem.used >> 20
            g["unsupported"] = errs
            bad = []
            if g.get("ecc_volatile_uncorrected"):
                bad.append(f"{g['ecc_volatile_uncorrected']} uncorrected ECC errors since the driver loaded")
            if rows is not None and (rows[2] or rows[3]):
                bad.append("row remapping pending or failed: reset the GPU")
            if g["retired_pages_pending"]:
                bad.append("retired pages pending: reset the GPU")
            g["healthy"] = not bad
            g["problems"] = bad
            out["gpus"].append(g)
        print(json.dumps(out, indent=1))
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__":
    main()
