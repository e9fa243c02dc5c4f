#!/usr/bin/env python3
"""Write a JSON record of a GPU test run: machine, software, commit, commands and per-test
outcomes parsed from pytest's JUnit XML. Generic: any GPU suite can call it.

    python scripts/record_gpu_results.py --suite gpu_check \\
        --run "python -m pytest -m 'gpu and not multigpu' tests/gpu" out/junit_gpu.xml 0 \\
        --run "torchrun ... -m pytest -m multigpu tests/gpu" "out/junit_multigpu_rank*.xml" 0 \\
        --out-dir docs/results --out-dir "$OUT"

Each ``--run COMMAND JUNIT_GLOB EXIT_CODE`` becomes one entry (a glob may match one file per
rank). The file is named ``<suite>_<kind>_<UTC date>.json``; ``kind`` is ``--kind``, else
``$MOK_DEVICE_KIND``, else made from the GPU name and count (``nvidia-h200-x2``). The commit is
``$MOK_COMMIT``, else ``docs/results/.commit``, else ``git rev-parse HEAD``, else "unknown".
Exit status: 0 when the record was written, whatever the tests did.
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_TEXT = 2000  # characters kept of a failure message or captured output


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _clip(text: str | None) -> str | None:
    if not text:
        return None
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + f"... [{len(text)} chars]"


# ---------------------------------------------------------------------------------------------
# Machine, software, commit
# ---------------------------------------------------------------------------------------------


def gpu_info() -> dict:
    info: dict = {"gpus": [], "gpu_count": 0, "driver_version": None}
    smi = _run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    )
    if smi:
        rows = [[c.strip() for c in line.split(",")] for line in smi.splitlines() if line.strip()]
        info["gpus"] = [r[0] for r in rows]
        info["gpu_count"] = len(rows)
        info["driver_version"] = rows[0][1] if rows and len(rows[0]) > 1 else None
        info["gpu_memory"] = [r[2] for r in rows if len(r) > 2]
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            names = [torch.cuda.get_device_name(i) for i in range(count)]
            info["gpus"], info["gpu_count"] = info["gpus"] or names, info["gpu_count"] or count
            info["compute_capability"] = [
                "{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(count)
            ]
    except Exception as exc:  # the record is still worth writing
        info["torch_cuda_error"] = f"{type(exc).__name__}: {exc}"
    return info


def software_info() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["cudnn"] = (
            torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        )
        info["nccl"] = (
            ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
        )
    except Exception as exc:
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    nvcc = _run(["nvcc", "--version"])
    match = re.search(r"release ([\d.]+)", nvcc or "")
    info["nvcc"] = match.group(1) if match else None
    return info


def extension_info() -> dict:
    sys.path.insert(0, str(ROOT))
    try:
        from mok_megatron import ops

        return {"available": ops.extension_available(), "error": ops.extension_error()}
    except Exception as exc:
        return {"available": False, "error": f"{type(exc).__name__}: {exc}"}


def commit_info() -> tuple[str, str]:
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"], "MOK_COMMIT"
    commit_file = ROOT / "docs" / "results" / ".commit"
    if commit_file.is_file() and commit_file.read_text().strip():
        return commit_file.read_text().strip(), "docs/results/.commit"
    head = _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    if head:
        dirty = _run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
        return head + ("-dirty" if dirty else ""), "git"
    return "unknown", "none"


def device_kind(explicit: str | None, gpus: dict) -> str:
    kind = explicit or os.environ.get("MOK_DEVICE_KIND")
    if not kind:
        name = gpus["gpus"][0] if gpus["gpus"] else "nogpu"
        kind = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        kind = re.sub(r"-\d+gb$", "", kind)  # "nvidia-h200-141gb" -> "nvidia-h200"
        if gpus["gpu_count"] > 1:
            kind += f"-x{gpus['gpu_count']}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", kind)


# ---------------------------------------------------------------------------------------------
# JUnit XML
# ---------------------------------------------------------------------------------------------

OUTCOMES = ("passed", "failed", "error", "skipped")


def _captured_output(element: ET.Element | None) -> str | None:
    """A test's printed output without pytest's "--- Captured Out ---" banners."""
    if element is None or not element.text:
        return None
    lines = [ln for ln in element.text.splitlines() if not re.fullmatch(r"-+ Captured .* -+", ln)]
    return _clip("\n".join(lines).strip())


def parse_junit(path: str) -> list[dict]:
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = {
            "id": f"{case.get('classname', '')}::{case.get('name', '')}",
            "outcome": "passed",
            "time_s": round(float(case.get("time", 0) or 0), 4),
        }
        for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                test["outcome"] = outcome
                test["message"] = _clip(element.get("message") or element.text)
                break
        stdout = _captured_output(case.find("system-out"))
        if stdout:
            test["stdout"] = stdout
        tests.append(test)
    return tests


def totals_of(tests: list[dict]) -> dict:
    totals = {outcome: sum(t["outcome"] == outcome for t in tests) for outcome in OUTCOMES}
    totals["total"] = len(tests)
    return totals


def run_record(command: str, junit_glob: str, exit_code: str) -> dict:
    files = sorted(glob.glob(junit_glob))
    record: dict = {"command": command, "exit_code": int(exit_code), "junit": files, "tests": []}
    for path in files:
        label = Path(path).stem
        try:
            tests = parse_junit(path)
        except (ET.ParseError, OSError) as exc:
            record.setdefault("junit_errors", []).append(f"{path}: {exc}")
            continue
        if len(files) > 1:  # one file per rank: say which
            for test in tests:
                test["file"] = label
        record["tests"] += tests
    if not files:
        record["junit_errors"] = [f"no JUnit XML matched {junit_glob} (the run crashed early?)"]
    record["totals"] = totals_of(record["tests"])
    return record


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default="gpu_check", help="record name prefix")
    parser.add_argument("--kind", help="device kind for the file name (default: from the GPUs)")
    parser.add_argument(
        "--run",
        nargs=3,
        action="append",
        default=[],
        metavar=("COMMAND", "JUNIT_GLOB", "EXIT_CODE"),
        help="one test command, its JUnit XML file(s) and its exit code; repeatable",
    )
    parser.add_argument("--out-dir", action="append", default=[], help="where to write; repeatable")
    parser.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    now = dt.datetime.now(dt.UTC)
    gpus = gpu_info()
    commit, commit_source = commit_info()
    runs = [run_record(*run) for run in args.run]
    totals = {key: sum(r["totals"][key] for r in runs) for key in (*OUTCOMES, "total")}
    record = {
        "suite": args.suite,
        "created_utc": now.isoformat(timespec="seconds"),
        "commit": commit,
        "commit_source": commit_source,
        "device_kind": device_kind(args.kind, gpus),
        "hardware": gpus,
        "software": software_info(),
        "extension": extension_info(),
        "runs": runs,
        "totals": totals,
        "ok": all(r["exit_code"] == 0 for r in runs) and totals["failed"] + totals["error"] == 0,
        "extra": dict(item.split("=", 1) for item in args.extra),
    }
    name = f"{args.suite}_{record['device_kind']}_{now.date().isoformat()}.json"
    out_dirs = args.out_dir or [str(ROOT / "docs" / "results")]
    for out_dir in dict.fromkeys(d for d in out_dirs if d):
        path = Path(out_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"record_gpu_results: wrote {path}")
    print(
        f"record_gpu_results: {totals['passed']} passed, {totals['failed']} failed, "
        f"{totals['error']} errors, {totals['skipped']} skipped"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
