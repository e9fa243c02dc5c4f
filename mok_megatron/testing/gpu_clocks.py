"""The GPU's SM clock and power while something is timed, sampled through NVML.

The floor model (``timing.moe_pass_cost``) assumes the GPU's full clock; under a long GEMM-heavy
run an H200 reaches its power limit and lowers the clock (nvidia-smi's clock-event reason 0x4,
the software power cap). ``ClockSampler`` reads the SM clock and the power draw every
``period_s`` on a thread while its ``with`` block runs, so a benchmark can say what clock its
times were taken at. NVML is called through ctypes (``libnvidia-ml.so.1``, the library nvidia-smi
uses): no subprocess, and each call releases the GIL. Where NVML cannot be loaded (no NVIDIA
driver, as on a CPU machine) the sampler records nothing and ``summary()`` is None.
"""

from __future__ import annotations

import ctypes
import functools
import statistics
import threading
from collections.abc import Callable

__all__ = ["ClockSampler", "cuda_reader", "nvml_reader", "nvml_uuid"]

#: One sample: (SM clock in MHz, power draw in W).
Reader = Callable[[], "tuple[float, float] | None"]

_NVML_SUCCESS = 0
_NVML_CLOCK_SM = 1


def nvml_uuid(uuid: object) -> bytes:
    """NVML's name of the GPU with this UUID: torch's ``get_device_properties(i).uuid`` is not a
    str (its ``str()`` is the bare UUID), NVML's names start with ``GPU-``."""
    name = str(uuid)
    return (name if name.startswith("GPU-") else f"GPU-{name}").encode()


def nvml_reader(uuid: object) -> Reader | None:
    """A function reading (SM MHz, W) of the GPU with this UUID (a str, or torch's
    ``get_device_properties(i).uuid``), or None where NVML or the GPU cannot be found."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != _NVML_SUCCESS:
            return None
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByUUID(nvml_uuid(uuid), ctypes.byref(handle)) != _NVML_SUCCESS:
            return None
    except (OSError, AttributeError):
        return None

    def read() -> tuple[float, float] | None:
        mhz, milliwatts = ctypes.c_uint(), ctypes.c_uint()
        if lib.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM, ctypes.byref(mhz)) != _NVML_SUCCESS:
            return None
        if lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(milliwatts)) != _NVML_SUCCESS:
            return None
        return float(mhz.value), milliwatts.value / 1e3

    return read


@functools.cache
def cuda_reader() -> Reader | None:
    """``nvml_reader`` of torch's current CUDA device (made once per process), or None without
    CUDA or NVML."""
    import torch

    if not torch.cuda.is_available():
        return None
    return nvml_reader(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


class ClockSampler:
    """``with ClockSampler(read):`` samples ``read()`` every ``period_s`` seconds on a thread
    (and once at the start and at the end); ``summary()`` gives the samples' SM clock median,
    minimum and maximum and the power draw's median, or None without samples (``read`` None,
    or every read failed)."""

    def __init__(self, read: Reader | None, period_s: float = 0.01):
        self._read, self._period = read, period_s
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        value = self._read()
        if value is not None:
            self._samples.append(value)

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            self._sample()

    def __enter__(self) -> ClockSampler:
        if self._read is not None:
            self._sample()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()

    def summary(self) -> dict | None:
        if not self._samples:
            return None
        mhz = [s[0] for s in self._samples]
        return {"samples": len(mhz), "sm_mhz_median": statistics.median(mhz),
                "sm_mhz_min": min(mhz), "sm_mhz_max": max(mhz),
                "power_w_median": statistics.median(s[1] for s in self._samples)}  # fmt: skip
