"""A stand-in for NVIDIA's `pynvml` (nvidia-ml-py) for the gpu_check test: one healthy
NVIDIA H200 answering the calls scripts/gpu_check/health.py makes, with the values a real
idle H200 gives; retired pages are "not supported", as on Hopper (it remaps rows instead).
Only on PYTHONPATH in integration/gpu_check.rs; never installed."""

__version__ = "stub"

NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1


class NVMLError(Exception):
    pass


class _Memory:
    total = 143771 << 20
    used = 0


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlSystemGetDriverVersion():
    return "580.95.05"


def nvmlDeviceGetCount():
    return 1


def nvmlDeviceGetHandleByIndex(i):
    if i != 0:
        raise NVMLError("Invalid Argument")
    return "h0"


def nvmlDeviceGetName(_h):
    return "NVIDIA H200"


def nvmlDeviceGetUUID(_h):
    return "GPU-5c3a1f0e-8d2b-4c11-9e7a-2f6b0d4e8a13"


def nvmlDeviceGetTemperature(_h, _sensor):
    return 31


def nvmlDeviceGetEccMode(_h):
    return (1, 1)


def nvmlDeviceGetTotalEccErrors(_h, _etype, _counter):
    return 0


def nvmlDeviceGetRemappedRows(_h):
    return (0, 0, 0, 0)


def nvmlDeviceGetRetiredPagesPendingStatus(_h):
    raise NVMLError("Not Supported")


def nvmlDeviceGetPowerUsage(_h):
    return 74512


def nvmlDeviceGetEnforcedPowerLimit(_h):
    return 700000


def nvmlDeviceGetPerformanceState(_h):
    return 0


def nvmlDeviceGetCurrentClocksEventReasons(_h):
    return 0x1


def nvmlDeviceGetMemoryInfo(_h):
    return _Memory()
