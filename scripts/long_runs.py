#!/usr/bin/env python
"""The long runs of issue 17, item 4, on the machine this runs on, recorded as one JSON file.

    python scripts/long_runs.py --out $OUT/long_runs.json                  (a GPU: everything)
    python scripts/long_runs.py --out $OUT/long_runs.json --skip-cpu-demo

On a GPU: 1000 forward + backward passes of the CUDA backend (stage 1 with separate and with
fused gate/up weights, the megakernel forward where it can run) each bitwise equal to the first
with the reserved memory flat after the warm-up; configs/tiny_gpu_ep1.yaml trained 2000 steps;
and the CPU demo (configs/tiny_cpu.yaml, 2 gloo ranks on this machine's CPUs) trained 500 steps.
Without a GPU: the CPU parts only (reference-backend passes on CPU, the CPU demo).
The rules each run is held to are ``testing.long_runs.failures``; the exit status is 1 when a
run broke one or raised (the record is written first, the error in it), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


def planned_runs(args, cuda: bool) -> list[tuple[str, dict]]:
    """(function name, keyword arguments) of every run for this machine, in order."""
    runs = []
    if cuda:
        from mok_megatron.functional.cuda.mega import unavailable_here

        runs += [("repeat_passes", {"num_passes": args.gpu_passes, "cuda_forward": "stage1",
                                    "fused_gate_up": fused}) for fused in (False, True)]  # fmt: skip
        if unavailable_here() is None:
            runs.append(("repeat_passes", {"num_passes": args.gpu_passes,
                                           "cuda_forward": "megakernel"}))  # fmt: skip
        runs.append(("train_steps", {"config_path": _config("tiny_gpu_ep1.yaml"),
                                     "steps": args.gpu_steps}))  # fmt: skip
    else:
        runs.append(("repeat_passes", {"num_passes": args.cpu_passes, "device": "cpu",
                                       "backend": "reference"}))  # fmt: skip
    if not args.skip_cpu_demo:
        runs.append(("train_steps", {"config_path": _config("tiny_cpu.yaml"),
                                     "steps": args.cpu_steps}))  # fmt: skip
    return runs


def _config(name: str) -> str:
    """configs/NAME, relative to the working directory (as the record shows it)."""
    return os.path.relpath(ROOT / "configs" / name)


def run_one(name: str, kwargs: dict) -> dict:
    """The run's record with its ``failures``; a run that raised: its arguments and the error."""
    from mok_megatron.testing import long_runs

    try:
        record = getattr(long_runs, name)(**kwargs)
    except Exception:
        error = traceback.format_exc()
        return {"kind": name, "arguments": kwargs, "error": error, "failures": [error[-2000:]]}
    return {**record, "arguments": kwargs, "failures": long_runs.failures(record)}


def _label(record: dict) -> str:
    """The path of a passes run, the config file of a training run."""
    given = record["arguments"]
    if record["kind"] == "train_steps":
        return Path(given["config_path"]).name
    return record.get("path") or f"{given.get('backend', 'cuda')}/{given.get('cuda_forward')}"


def summary_line(record: dict) -> str:
    head = f"{record['kind']:<13} {_label(record):<18}"
    if "error" in record:
        return f"{head} RAISED"
    if record["kind"] == "repeat_passes":
        figures = (f"{record['passes']} passes ({record['gate_up']}), "
                   f"{record['mismatching_passes']} differ, {record['memory_kind']} drift "
                   f"{record['memory_drift_bytes']} B, spread {record['memory_spread_bytes']} B, "
                   f"{record['seconds']:.1f} s")  # fmt: skip
    else:
        figures = (f"{record['steps']} steps x {record['world']} rank(s), loss "
                   f"{record['first_loss']:.3f} -> {record['final_loss']:.3f}, "
                   f"{record['memory_kind']} drift {record['memory_drift_bytes']} B, tail "
                   f"{record['memory_tail_drift_bytes']} B, {record['seconds']:.1f} s")  # fmt: skip
    return f"{head} {'FAILED' if record['failures'] else 'ok'}  {figures}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON record to write")
    ap.add_argument("--skip-cpu-demo", action="store_true", help="leave out the CPU demo")
    ap.add_argument("--gpu-passes", type=int, default=1000)
    ap.add_argument("--gpu-steps", type=int, default=2000)
    ap.add_argument("--cpu-passes", type=int, default=100, help="CPU-only machines")
    ap.add_argument("--cpu-steps", type=int, default=500)
    args = ap.parse_args()

    import torch

    from mok_megatron.testing.records import commit

    cuda = torch.cuda.is_available()
    record = {
        "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
        "commit": commit(), "host_cpus": os.cpu_count(), "runs": [],
    }  # fmt: skip
    for name, kwargs in planned_runs(args, cuda):
        record["runs"].append(run_one(name, kwargs))
        print(summary_line(record["runs"][-1]), flush=True)
        with open(args.out, "w") as f:  # after every run: a later crash keeps the earlier ones
            json.dump(record, f, indent=1)
    failed = [r for r in record["runs"] if r["failures"]]
    for run in failed:
        print(f"FAILED {run['kind']} {run['arguments']}:\n  " + "\n  ".join(run["failures"]))
    print(f"{len(record['runs']) - len(failed)}/{len(record['runs'])} runs passed; {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
