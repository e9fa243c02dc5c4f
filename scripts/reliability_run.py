#!/usr/bin/env python
"""The reliability figures (issue 17): run the reliability tests and the long runs on this
machine, record what they showed, and render docs/RELIABILITY.md from the records.

    python scripts/reliability_run.py --run --out $OUT/reliability_<gpu>_<commit>.json
        (pytest over RELIABILITY_TESTS with a junit file, then scripts/long_runs.py; on a GPU
        machine both the CPU and the GPU tests run; --skip-long leaves the long runs out)
    python scripts/reliability_run.py --run --tests cpu --out R.json --add-junit junit_gpu.xml \
        --gpu-check gpu_check_<kind>_<date>.json
        (the CPU tests and the long runs here, with the GPU reliability tests of a junit file of
        the same commit and machine: scripts/gpu_check.sh's, run with -o junit_family=xunit1)
    python scripts/reliability_run.py --tests-record T.json --long-runs L.json --out R.json
        (one record from a --run --skip-long record and a scripts/long_runs.py record made
        separately, on the same machine and commit: both are checked)
    python scripts/reliability_run.py --render docs/results/reliability_*.json --md docs/RELIABILITY.md

Every figure in the page comes from a record: test outcomes and the properties the tests record
(``record_property``: seconds to the error, sweep outcomes, kinds tried), and the long runs'
JSON. Nothing is typed in. The record also says which tests were skipped and why (the two-GPU
ones on a one-GPU machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mok_megatron.testing.records import commit  # noqa: E402

#: Issue 17's items and the test files that show each (CPU: reference backend; GPU: CUDA).
ITEMS = {
    "1": ("a rank that fails mid-pass", ["tests/cpu/test_reference_timeouts.py",
                                         "tests/gpu/test_rank_faults_cuda.py"]),
    "2": ("poisoned input stays local", ["tests/cpu/test_poison_locality.py",
                                         "tests/gpu/test_poison_locality_cuda.py"]),
    "3": ("bad input", ["tests/cpu/test_bad_input.py", "tests/gpu/test_bad_input_cuda.py"]),
    "4": ("long runs", ["tests/cpu/test_long_runs.py", "tests/gpu/test_long_runs_cuda.py"]),
    "5": ("capacity and skew", ["tests/cpu/test_skew_sweep.py",
                                "tests/gpu/test_skew_sweep_cuda.py"]),
}  # fmt: skip
RELIABILITY_TESTS = [f for _, files in ITEMS.values() for f in files]


def run_pytest(junit: str, which: str = "all") -> int:
    files = [f for f in RELIABILITY_TESTS if which == "all" or f.startswith(f"tests/{which}/")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "junit_family=xunit1", *files]  # fmt: skip
    print("[reliability]", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def run_long(out: str, skip_cpu_demo: bool) -> int:
    cmd = [sys.executable, "scripts/long_runs.py", "--out", out]
    if skip_cpu_demo:
        cmd.append("--skip-cpu-demo")
    print("[reliability]", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def parse_junit(path: str) -> list[dict]:
    """One dict per test case: file, name, outcome, seconds, skip reason, recorded properties."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, reason = "passed", None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = (node.get("message") or "")[:300]
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases.append({
            "file": case.get("file") or case.get("classname", "").replace(".", "/") + ".py",
            "name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
            "reason": reason, "properties": props,
        })  # fmt: skip
    return cases


def item_of(file: str) -> str | None:
    for item, (_, files) in ITEMS.items():
        if any(file.endswith(f) or f.endswith(file) for f in files):
            return item
    return None


def assemble(junit: str, long_runs: str | None) -> dict:
    import torch

    cases = parse_junit(junit)
    for case in cases:
        case["item"] = item_of(case["file"])
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "commit": commit(), "host_cpus": os.cpu_count(),
        "utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tests": cases,
        "long_runs": json.load(open(long_runs)) if long_runs else None,
    }  # fmt: skip


#: The bad-input test that runs each kind of testing/bad_input.py's table (one case per kind,
#: weight form and path); its case ids name them: "[kind-form]" (CPU), "[path-form-kind]" (GPU).
BAD_INPUT_TEST = "test_bad_input_raises_naming_the_rule_and_writes_nothing"


def bad_input_kinds(tests: list[dict]) -> dict[str, dict[str, int]]:
    """By path: how many distinct kinds of the table the record's tests ran, and passed."""
    out: dict[str, dict[str, int]] = {}
    for t in tests:
        name, _, case = t["name"].partition("[")
        if name != BAD_INPUT_TEST or t["outcome"] == "skipped":
            continue
        case = case.rstrip("]")
        if "/gpu/" in t["file"]:
            path, _, kind = case.split("-", 2)
        else:
            path, kind = "reference", case.rsplit("-", 1)[0]
        seen = out.setdefault(path, {"ran": set(), "failed": set()})
        seen["ran"].add(kind)
        if t["outcome"] != "passed":
            seen["failed"].add(kind)
    return {p: {"kinds": len(v["ran"]), "failed": len(v["failed"])} for p, v in out.items()}


def merge(tests_record: str, long_runs: str | None) -> dict:
    record = json.load(open(tests_record))
    if long_runs:
        runs = json.load(open(long_runs))
        for key in ("gpu", "torch", "commit"):
            if runs.get(key) != record.get(key):
                raise SystemExit(f"{key} differs: {record.get(key)} (tests) vs {runs.get(key)} "
                                 "(long runs); merge records of one machine and commit")  # fmt: skip
        record["long_runs"] = runs
    return record


# ------------------------------------------------------------------------------------ render
HEADER = """# Reliability

Generated by `scripts/reliability_run.py` from the records listed below; do not edit by hand.
Each figure is what a test or a long run showed on that machine at that commit (issue 17). The
CPU tests run the reference backend over gloo ranks; the GPU tests the CUDA backend on one GPU,
its multi-rank cases on *virtual ranks* (W ranks of one process, MEGAKERNEL.md). The tests
marked for two GPUs (`-m multigpu`: real ranks that stall or exit, in
tests/gpu/test_rank_faults_cuda.py, and configs that differ across ranks, in
tests/gpu/test_bad_input_cuda.py) run only where two GPUs are lent; a record made on one GPU
holds none of them. The CUDA backend's timeout names the barrier's phase (e.g. "dispatch/tokens
staged", which the forward's x and the backward's d_out both pass), not the pass.
"""


def _backend(file: str) -> str:
    return "CUDA (GPU)" if "/gpu/" in file else "reference (CPU)"


def _short(name: str) -> str:
    return name.replace("test_", "", 1)


def render_record(path: str, rec: dict) -> list[str]:
    tests = [t for t in rec["tests"] if t["item"]]
    gpu_check = rec.get("gpu_check")
    joined = (f" GPU reliability tests from `{gpu_check['file']}`'s run ({gpu_check['created_utc']}: "
              f"{gpu_check['totals']['passed']} GPU tests passed, {gpu_check['totals']['failed']} "
              "failed in all)." if gpu_check else "")  # fmt: skip
    lines = [f"## `{os.path.basename(path)}`", "",
             f"{rec['gpu'] or 'no GPU'}, torch {rec['torch']}, commit `{rec['commit'][:7]}`, "
             f"{rec['host_cpus']} CPUs; run {rec['utc']}.{joined}", "",
             "| item | what | backend | passed | failed | skipped |", "|---|---|---|---|---|---|"]  # fmt: skip
    for item, (what, _) in ITEMS.items():
        for backend in ("reference (CPU)", "CUDA (GPU)"):
            mine = [t for t in tests if t["item"] == item and _backend(t["file"]) == backend]
            if not mine:  # e.g. the GPU tests in a record made on a CPU machine
                continue
            count = {o: sum(t["outcome"] == o for t in mine) for o in ("passed", "skipped")}
            failed = len(mine) - count["passed"] - count["skipped"]
            lines.append(f"| {item} | {what} | {backend} | {count['passed']} | {failed} | "
                         f"{count['skipped']} |")  # fmt: skip
    lines += ["", "### 1. Faults injected (a rank stops at a step; the others must raise)", "",
              "| backend | test | outcome | seconds to the error |", "|---|---|---|---|"]  # fmt: skip
    for t in tests:
        if t["item"] == "1":
            secs = t["properties"].get("seconds_to_error", "-")
            lines.append(f"| {_backend(t['file'])} | `{_short(t['name'])}` | {t['outcome']} | "
                         f"{secs} |")  # fmt: skip
    kinds = bad_input_kinds(tests)
    lines += ["", "### 3. Bad input", ""]
    if kinds:
        table = ", ".join(
            f"{path} {v['kinds']} ({v['failed']} failed)" for path, v in kinds.items()
        )
        lines += [f"Distinct kinds of testing/bad_input.py's table run, by path: {table}. An "
                  "expert id out of range is deferred on the CUDA backend (found on the device, "
                  "raised at the next host-visible point; the schedule's own regions are written). "
                  "A config that differs across ranks is tested with real ranks (gloo on CPU in "
                  "tests/cpu/test_functional_ep.py, NCCL with -m multigpu): not in this record.",
                  ""]  # fmt: skip
    lines += ["| backend | tests run (each kind in each weight form and path, and the rules "
              "around them) | passed: raised as the rule says, nothing written (deferred kinds: "
              "see above) | not |",
              "|---|---|---|---|"]  # fmt: skip
    for backend in ("reference (CPU)", "CUDA (GPU)"):
        mine = [t for t in tests if t["item"] == "3" and _backend(t["file"]) == backend
                and t["outcome"] != "skipped"]  # fmt: skip
        if not mine:  # no tests of this backend in the record
            continue
        ok = sum(t["outcome"] == "passed" for t in mine)
        lines.append(f"| {backend} | {len(mine)} | {ok} | {len(mine) - ok} |")
    lines += ["", "### 5. Skew sweeps (uniform to every first slot on expert 0)", "",
              "| backend | test | outcome | points (ran / raised MoKCapacityError) | pass peak "
              "bytes over the inputs |", "|---|---|---|---|---|"]  # fmt: skip
    for t in tests:
        if t["item"] == "5":
            p = t["properties"]
            lines.append(f"| {_backend(t['file'])} | `{_short(t['name'])}` | {t['outcome']} | "
                         f"{p.get('outcomes', '-')} | {p.get('peak_bytes', '-')} |")  # fmt: skip
    lines += ["", "### 4. Long runs", ""]
    runs = (rec.get("long_runs") or {}).get("runs", [])
    if not runs:
        lines.append("No long runs in this record.")
    for run in runs:
        lines.append("- " + _long_run_line(run))
    failing = [t for t in tests if t["outcome"] in ("failed", "error")]
    if failing:
        lines += ["", "### Failures", ""]
        lines += [f"- `{t['file']}::{t['name']}`: {t['reason']}" for t in failing]
    skipped = sorted({t["reason"] for t in tests if t["outcome"] == "skipped"})
    if skipped:
        lines += ["", "Skipped, and why: " + "; ".join(f"{r}" for r in skipped) + "."]
    return lines


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.2f} MiB"


def _long_run_line(run: dict) -> str:
    """One long run (scripts/long_runs.py's record) in a sentence; memory figures from the
    warm-up on: drift = end - after warm-up, spread = max - min, tail = over the second half."""
    kind = run.get("memory_kind")
    memory = (f"{kind} memory after warm-up {_ranks(run.get('memory_after_warmup'))}, "
              f"drift {_ranks(run.get('memory_drift_bytes'))}, spread "
              f"{_ranks(run.get('memory_spread_bytes'))}, second-half drift "
              f"{_ranks(run.get('memory_tail_drift_bytes'))}")  # fmt: skip
    if "allocated_drift_bytes" in run:
        memory += f"; allocated bytes drift {_ranks(run['allocated_drift_bytes'])}"
    verdict = "passed" if not run.get("failures") else f"FAILED: {run['failures']}"
    if run.get("kind") == "repeat_passes":
        return (f"{run['passes']} forward + backward passes on one workspace, {run['path']} "
                f"({run.get('gate_up')} gate/up, {run.get('dtype')}) on {run['device']}: "
                f"{run['mismatching_passes']} not bitwise equal to the first; {memory}; "
                f"{run['seconds']:.1f} s; {verdict}.")  # fmt: skip
    return (f"`{run.get('config')}` trained {run.get('steps')} steps on {run.get('device')} "
            f"({run.get('world')} rank(s)): every loss finite: {run.get('all_losses_finite')}, "
            f"first {run.get('first_loss', float('nan')):.4f}, final "
            f"{run.get('final_loss', float('nan')):.4f}; {memory}; "
            f"{run.get('seconds', 0):.1f} s; {verdict}.")  # fmt: skip


def _ranks(value) -> str:
    """A figure in MiB; a per-rank list as every rank's, in rank order."""
    if isinstance(value, list):
        return "[" + ", ".join(_mib(v).removesuffix(" MiB") for v in value) + "] MiB by rank"
    return _mib(value)


def render(paths: list[str], md: str | None) -> None:
    lines = [HEADER, "## Records", ""]
    recs = [(p, json.load(open(p))) for p in paths]
    lines += [f"- `{os.path.basename(p)}`" for p, _ in recs] + [""]
    for p, rec in recs:
        lines += render_record(p, rec) + [""]
    text = "\n".join(lines)
    if md:
        Path(md).write_text(text)
    else:
        print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--run", action="store_true", help="run the tests and the long runs here")
    ap.add_argument("--skip-long", action="store_true")
    ap.add_argument("--skip-cpu-demo", action="store_true", help="long runs without the CPU demo")
    ap.add_argument(
        "--tests",
        choices=["all", "cpu", "gpu"],
        default="all",
        help="with --run: which of the reliability tests to run",
    )
    ap.add_argument(
        "--add-junit",
        nargs="+",
        default=[],
        help="junit files (junit_family=xunit1) of the same commit and machine, e.g. "
        "scripts/gpu_check.sh's: their reliability tests join the record",
    )
    ap.add_argument(
        "--gpu-check",
        help="with --add-junit: the gpu_check JSON record of that run "
        "(its commit and GPU must be the record's)",
    )
    ap.add_argument("--tests-record", help="a record made with --run --skip-long")
    ap.add_argument("--long-runs", help="a scripts/long_runs.py record made separately")
    ap.add_argument("--out", help="the record to write")
    ap.add_argument("--render", nargs="+", help="records to render")
    ap.add_argument("--md", help="with --render: the page to write")
    args = ap.parse_args()
    if args.render:
        render(args.render, args.md)
        return
    if not args.out:
        ap.error("give --out (with --run, or --tests-record) or --render")
    status = 0
    if args.tests_record:
        record = merge(args.tests_record, args.long_runs)
    elif args.run:
        with tempfile.TemporaryDirectory(prefix="mok_rel_") as tmp:
            junit = os.path.join(tmp, "junit.xml")
            status |= run_pytest(junit, args.tests)
            long_runs = None
            if not args.skip_long:
                long_runs = os.path.join(tmp, "long_runs.json")
                status |= run_long(long_runs, args.skip_cpu_demo)
            record = assemble(junit, long_runs if long_runs and os.path.exists(long_runs) else None)
    else:
        ap.error("give --run or --tests-record")
    if args.add_junit and not args.gpu_check:
        ap.error("--add-junit needs --gpu-check (the gpu_check record of the same run)")
    if args.gpu_check:
        gpu = json.load(open(args.gpu_check))
        if (
            gpu["commit"][:7] != record["commit"][:7]
            or record["gpu"] not in gpu["hardware"]["gpus"]
        ):
            raise SystemExit(f"{args.gpu_check} is of commit {gpu['commit']} on "
                             f"{gpu['hardware']['gpus']}, the record of {record['commit']} on "
                             f"{record['gpu']}: add junit files of the same commit and GPU")  # fmt: skip
        record["gpu_check"] = {"file": os.path.basename(args.gpu_check), "commit": gpu["commit"],
                               "created_utc": gpu["created_utc"], "totals": gpu["totals"]}  # fmt: skip
    for path in args.add_junit:
        extra = [dict(c, item=item_of(c["file"])) for c in parse_junit(path)]
        record["tests"] += [c for c in extra if c["item"]]
        record.setdefault("added_junit", []).append(os.path.basename(path))
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("\n".join(render_record(args.out, record)))
    sys.exit(1 if status else 0)


if __name__ == "__main__":
    main()
