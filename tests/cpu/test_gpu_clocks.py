"""testing.gpu_clocks: the clock sampler's summary, and that it records nothing without NVML."""

from __future__ import annotations

import itertools
import statistics
import time

from mok_megatron.testing.gpu_clocks import ClockSampler, nvml_reader, nvml_uuid


def test_the_sampler_summarises_what_it_read_while_its_block_ran():
    clocks = itertools.cycle([(1500.0, 600.0), (1300.0, 700.0), (1700.0, 650.0)])
    reads = []

    def read():
        reads.append(next(clocks))
        return reads[-1]

    with ClockSampler(read, period_s=0.001) as sampler:
        time.sleep(0.05)
    after = len(reads)
    time.sleep(0.01)
    assert len(reads) == after, "the sampler kept reading after its block"
    summary = sampler.summary()
    assert summary["samples"] == after >= 3
    mhz = sorted(r[0] for r in reads)
    assert summary["sm_mhz_min"] == mhz[0] == 1300.0 and summary["sm_mhz_max"] == mhz[-1] == 1700.0
    assert summary["sm_mhz_median"] == statistics.median(mhz)
    assert summary["power_w_median"] == statistics.median(r[1] for r in reads)


def test_without_nvml_or_readings_there_is_no_summary():
    with ClockSampler(None) as sampler:
        pass
    assert sampler.summary() is None
    with ClockSampler(lambda: None, period_s=0.001) as sampler:
        time.sleep(0.01)
    assert sampler.summary() is None
    # no driver (a CPU machine), or a driver without this GPU: no reader
    assert nvml_reader("00000000-0000-0000-0000-000000000000") is None


def test_nvml_names_the_gpu_from_torchs_uuid_object():
    # torch's device property `uuid` is an object whose str() is the bare UUID (no startswith):
    # the reader once failed on it and every record's gpu_during was None
    class TorchUuid:
        def __str__(self):
            return "5a3f0c1e-0000-4000-8000-00000000abcd"

    assert nvml_uuid(TorchUuid()) == b"GPU-5a3f0c1e-0000-4000-8000-00000000abcd"
    assert nvml_uuid("GPU-5a3f0c1e-0000-4000-8000-00000000abcd") == (
        b"GPU-5a3f0c1e-0000-4000-8000-00000000abcd"
    )
    assert nvml_reader(TorchUuid()) is None  # no driver here
