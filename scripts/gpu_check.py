"""``make gpu-check``: the first run of this package on a GPU, in one command.

Checks that a CUDA device is visible (and stops with an error otherwise),
runs the CUDA tests (``pytest -m cuda``), then the dense and MoE
training-step benchmarks (``benchmarks/train_step.py``,
``benchmarks/train_step_moe.py``) as a GPU user trains: bf16 autocast, the
``torch`` and ``fla`` Gated DeltaNet kernels, eager and compiled, at the
reference configurations and at real model shapes (Qwen3.5-0.8B, and 4
layers of Qwen3.5-35B-A3B, on 4,096 tokens). Each configuration runs in its
own process group with a time limit, so one that fails or hangs is recorded
with its error and the others still run; the whole check keeps within
``--budget-s`` (30 minutes), the most telling configurations first. The
``fla`` configurations are skipped, with the reason, where fla-core cannot
train on the GPU (``qwen35_fs2.ops.backend.fla_unavailable_reason``).

Writes one JSON report (``gpu_check_report.json`` at the top of the
repository, or ``--output``): the device, the versions, the test results and,
per configuration, tokens/s, MFU and peak CUDA memory, with each benchmark's
own report. It is rewritten after every step, so an interrupted check keeps
what it measured. Exits with 1 if a test or a configuration failed.

Installs nothing: ``make setup`` installs fla-core with the test extras.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

REPO_ROOT: Final = Path(__file__).resolve().parent.parent

DEFAULT_OUTPUT: Final = REPO_ROOT / "gpu_check_report.json"

# Three warm-up steps: compiled models compile in the first (forward and
# backward) and may recompile once in the second; fla autotunes in the first.
NUM_WARMUP: Final = 3

NUM_STEPS: Final = 10

# Time limits of one configuration: the model's creation, compilation and
# fla's autotuning dominate, not the 13 steps (under 2 s each here).
EAGER_TIMEOUT_S: Final = 120.0

COMPILED_TIMEOUT_S: Final = 240.0

# fla autotunes each kernel at its first call for each new shape: on an
# H200, 3 of the CUDA tests took 200 s on a fresh machine.
TESTS_TIMEOUT_S: Final = 600.0

DEFAULT_BUDGET_S: Final = 1800.0

# Below this, a configuration is not started (it would not finish).
MIN_RUN_S: Final = 30.0

# How much of a failing command's stderr the report keeps.
ERROR_TAIL_CHARS: Final = 4000

VERSIONED_PACKAGES: Final = ("torch", "triton", "fla-core", "causal-conv1d", "fairseq2", "qwen35-fs2")


@dataclass(frozen=True, kw_only=True)
class BenchmarkRun:
    """One benchmark configuration: a script of ``benchmarks/`` and its
    options."""

    name: str

    script: str
    """The path of the script, relative to the top of the repository."""

    options: tuple[str, ...]

    timeout_s: float

    def command(self) -> list[str]:
        return [sys.executable, str(REPO_ROOT / self.script), *self.options]

    @property
    def uses_fla(self) -> bool:
        return "--backend=fla" in self.options


def gpu_check_runs() -> list[BenchmarkRun]:
    """Returns the configurations of the check, both models at both shapes
    on the ``torch`` and ``fla`` kernels, most telling first in case the
    budget runs out: eager ones, then compiled ones at the real shapes, then
    compiled ones at the reference shapes (whose steps take about a
    millisecond of GPU time, so that compiling them shows little). The
    matmul floor runs once per shape, with its eager ``torch``
    configuration."""
    models = (
        ("dense", "benchmarks/train_step.py", ("reference", "0.8b-4k")),
        ("moe", "benchmarks/train_step_moe.py", ("reference", "35b-a3b-4k")),
    )

    runs = []

    for compiled in (False, True):
        for model, script, shapes in models:
            for shape in shapes:
                for backend in ("torch", "fla"):
                    variants = "floor,ours" if backend == "torch" and not compiled else "ours"

                    options = [
                        "--device=cuda",
                        "--dtype=bf16",
                        f"--shape={shape}",
                        f"--backend={backend}",
                        f"--variants={variants}",
                        f"--num-warmup={NUM_WARMUP}",
                        f"--num-steps={NUM_STEPS}",
                    ]

                    if compiled:
                        options.append("--compile")

                    run = BenchmarkRun(
                        name=f"{model} {shape} {backend} {'compiled' if compiled else 'eager'}",
                        script=script,
                        options=tuple(options),
                        timeout_s=COMPILED_TIMEOUT_S if compiled else EAGER_TIMEOUT_S,
                    )

                    runs.append((compiled, compiled and shape == "reference", run))

    return [run for *_, run in sorted(runs, key=lambda item: item[:2])]


@dataclass(frozen=True, kw_only=True)
class CommandOutcome:
    returncode: int | None
    """``None`` if the command ran out of time."""

    stdout: str

    stderr: str

    wall_s: float


def run_command(command: list[str], timeout_s: float, *, capture: bool = True) -> CommandOutcome:
    """Runs ``command`` from the top of the repository in a process group of
    its own, and kills the whole group if it runs out of time or this
    process is interrupted: a benchmark's workers and inductor's compile
    workers are its grandchildren, and one left behind would hold the GPU.
    Without ``capture``, its output goes to this process's."""
    pipe = subprocess.PIPE if capture else None

    start = time.monotonic()

    with subprocess.Popen(command, cwd=REPO_ROOT, stdout=pipe, stderr=pipe, text=True, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except BaseException as ex:
            os.killpg(process.pid, signal.SIGKILL)

            stdout, stderr = process.communicate()

            if not isinstance(ex, subprocess.TimeoutExpired):
                raise

            return CommandOutcome(returncode=None, stdout=stdout or "", stderr=stderr or "", wall_s=time.monotonic() - start)

    return CommandOutcome(returncode=process.returncode, stdout=stdout or "", stderr=stderr or "", wall_s=time.monotonic() - start)


def _tail(text: str) -> str:
    return text[-ERROR_TAIL_CHARS:].strip()


def run_benchmark(run: BenchmarkRun, timeout_s: float) -> dict[str, Any]:
    """Runs ``run`` within ``timeout_s``; returns its entry of the report:
    ``status`` ``ok`` with the benchmark's report and, per variant, its
    tokens/s, MFU and peak CUDA memory, or ``failed`` / ``timeout`` with the
    error."""
    outcome = run_command(run.command(), timeout_s)

    entry: dict[str, Any] = {
        "name": run.name,
        "command": shlex.join(run.command()),
        "timeout_s": round(timeout_s, 1),
        "wall_s": round(outcome.wall_s, 1),
    }

    if outcome.returncode is None:
        entry.update(status="timeout", error=f"ran out of its {timeout_s:.0f} s; its stderr ends:\n{_tail(outcome.stderr)}")

        return entry

    if outcome.returncode != 0:
        entry.update(status="failed", error=f"exit code {outcome.returncode}; its stderr ends:\n{_tail(outcome.stderr)}")

        return entry

    lines = outcome.stdout.strip().splitlines()

    try:
        report = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        entry.update(status="failed", error=f"it printed no JSON report; its stdout ends:\n{_tail(outcome.stdout)}")

        return entry

    entry["status"] = "ok"

    entry["variants"] = {
        variant: {
            "tokens_per_s": report[variant]["tokens_per_s"],
            "step_s": report[variant]["step_s"],
            "mfu": report[variant].get("mfu"),
            "tflop_per_s": report[variant].get("tflop_per_s"),
            "peak_cuda_mib": report[variant].get("peak_cuda_mib"),
        }
        for variant in ("floor", "ours", "reference")
        if variant in report
    }

    entry["benchmark"] = report

    return entry


def describe_run(entry: dict[str, Any]) -> str:
    """Returns the progress line of a finished configuration."""
    if entry["status"] != "ok":
        last_line = entry["error"].strip().splitlines()[-1]

        return f"{entry['status'].upper()} after {entry['wall_s']:.0f} s: {last_line}"

    parts = []

    for variant, numbers in entry["variants"].items():
        text = f"{variant} {numbers['tokens_per_s']:,.0f} tokens/s"

        if numbers["mfu"] is not None:
            text += f", MFU {numbers['mfu']:.3f}"

        if numbers["peak_cuda_mib"] is not None:
            text += f", peak {numbers['peak_cuda_mib'] / 1024:.1f} GiB"

        parts.append(text)

    return f"ok in {entry['wall_s']:.0f} s: " + "; ".join(parts)


def read_junit(path: Path) -> dict[str, Any]:
    """Returns the counts of a pytest JUnit XML report and its failing
    tests, each with the first line of its message."""
    root = ET.parse(path).getroot()

    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))

    counts = {name: sum(int(suite.get(name, "0")) for suite in suites) for name in ("tests", "failures", "errors", "skipped")}

    failing = []

    for case in root.iter("testcase"):
        for problem in case:
            if problem.tag in ("failure", "error"):
                message = (problem.get("message") or "").strip()

                failing.append(
                    {
                        "test": f"{case.get('classname')}::{case.get('name')}",
                        "kind": problem.tag,
                        "message": message.splitlines()[0] if message else "",
                    }
                )

    return {
        "tests": counts["tests"],
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "failing": failing,
    }


def run_tests(pytest_args: list[str], junit_path: Path, timeout_s: float) -> dict[str, Any]:
    """Runs pytest with ``pytest_args`` within ``timeout_s``, its output on
    the console; returns its status (``passed``, ``failed``, ``all
    skipped``, ``no tests``, ``error`` or ``timeout``) with the counts of its
    JUnit report."""
    command = [sys.executable, "-m", "pytest", *pytest_args, f"--junitxml={junit_path}"]

    # Not the counts of an earlier run, if this one writes none.
    junit_path.unlink(missing_ok=True)

    outcome = run_command(command, timeout_s, capture=False)

    result: dict[str, Any] = {"command": shlex.join(command), "wall_s": round(outcome.wall_s, 1), "exit_code": outcome.returncode}

    # pytest's exit codes: 0 all passed, 1 some failed, 5 none collected.
    statuses = {None: "timeout", 0: "passed", 1: "failed", 5: "no tests"}

    result["status"] = statuses.get(outcome.returncode, "error")

    if junit_path.is_file():
        result.update(read_junit(junit_path))

    # pytest passes a run whose tests all skipped; the check does not.
    if result["status"] == "passed" and result.get("passed") == 0:
        result["status"] = "all skipped"

    return result


# Run in a subprocess: this process must not hold a CUDA context while the
# tests and benchmarks run (on a GPU in exclusive-process mode they would
# find it busy).
_DEVICE_QUERY: Final = """
import json, torch

device = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda, "available": torch.cuda.is_available()}

if device["available"]:
    from qwen35_fs2.ops.backend import fla_unavailable_reason

    properties = torch.cuda.get_device_properties(0)

    device.update(
        name=properties.name,
        compute_capability=f"{properties.major}.{properties.minor}",
        memory_gib=round(properties.total_memory / 2**30, 1),
        count=torch.cuda.device_count(),
        fla_unavailable=fla_unavailable_reason(),
    )

print(json.dumps(device))
"""


def cuda_device() -> dict[str, Any]:
    """Returns the visible CUDA device, with why fla-core cannot train on it
    (``fla_unavailable``, ``None`` if it can); exits with an error if there
    is none."""
    query = subprocess.run([sys.executable, "-c", _DEVICE_QUERY], capture_output=True, text=True)

    if query.returncode != 0:
        raise SystemExit(f"error: `make gpu-check` could not query the CUDA device:\n{_tail(query.stderr)}")

    device: dict[str, Any] = json.loads(query.stdout.strip().splitlines()[-1])

    if device["cuda_runtime"] is None:
        raise SystemExit(
            f"error: `make gpu-check` needs a CUDA build of PyTorch, but torch {device['torch']} is built for CPUs only."
        )

    if not device.pop("available"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")

        raise SystemExit(
            f"error: `make gpu-check` needs a CUDA device, but torch {device['torch']} (CUDA {device['cuda_runtime']}) sees none (CUDA_VISIBLE_DEVICES: {visible})."
        )

    device["driver"] = _nvidia_driver()

    return device


def _nvidia_driver() -> str | None:
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None

    return output.strip().splitlines()[0]


def package_versions() -> dict[str, str | None]:
    """Returns the installed version of each package the check depends on,
    ``None`` for those not installed."""
    versions: dict[str, str | None] = {}

    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None

    return versions


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_report(report: dict[str, Any], path: Path) -> None:
    """Writes ``report`` to ``path`` through a temporary file, so that the
    file always holds a whole report."""
    tmp_path = path.with_name(path.name + ".tmp")

    tmp_path.write_text(json.dumps(report, indent=2) + "\n")

    tmp_path.replace(path)


def run_benchmarks(
    runs: list[BenchmarkRun], deadline: float, report: dict[str, Any], output: Path, fla_unavailable: str | None
) -> bool:
    """Runs ``runs`` one after the other until ``deadline`` (a
    ``time.monotonic()`` value), each within its time limit and what is
    left; appends their entries to ``report["benchmarks"]`` and writes
    ``report`` to ``output`` after each. The runs that use fla are skipped,
    with ``fla_unavailable`` as the reason, if it is not ``None``: they would
    fail at their first step. Returns ``True`` if all the others ran and
    succeeded."""
    ok = True

    for idx, run in enumerate(runs, start=1):
        prefix = f"[{idx:2d}/{len(runs)}] {run.name}"

        if run.uses_fla and fla_unavailable is not None:
            report["benchmarks"].append({"name": run.name, "status": "skipped", "reason": f"fla cannot be used: {fla_unavailable}."})

            write_report(report, output)

            print(f"{prefix}: skipped (fla cannot be used)", flush=True)

            continue

        left_s = deadline - time.monotonic()

        if left_s < MIN_RUN_S:
            entry: dict[str, Any] = {"name": run.name, "status": "not run", "error": "the check's time budget was spent."}

            print(f"{prefix}: not run (the time budget was spent)", flush=True)
        else:
            print(f"{prefix} ...", flush=True)

            entry = run_benchmark(run, min(run.timeout_s, left_s))

            print(f"{prefix}: {describe_run(entry)}", flush=True)

        ok = ok and entry["status"] == "ok"

        report["benchmarks"].append(entry)

        write_report(report, output)

    return ok


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="the JSON report (default: %(default)s)")
    parser.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the time the whole check may take; configurations that would start later are not run (default: %(default)s)"
    )
    parser.add_argument("--only", action="append", metavar="TEXT", help="run only the configurations whose name contains TEXT (repeatable)")
    parser.add_argument("--skip-tests", action="store_true", help="run the benchmarks only")

    args = parser.parse_args(argv)

    deadline = time.monotonic() + args.budget_s

    runs = [run for run in gpu_check_runs() if args.only is None or any(text in run.name for text in args.only)]

    if not runs:
        parser.error(f"`--only` must match some configurations, but {args.only} matches none.")

    device = cuda_device()

    git_status = _git("status", "--porcelain")

    report: dict[str, Any] = {
        "started": _now(),
        "finished": None,
        "device": device,
        "versions": package_versions(),
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": None if git_status is None else bool(git_status),
        "budget_s": args.budget_s,
        "cuda_tests": None,
        "benchmarks": [],
    }

    write_report(report, args.output)

    print(f"gpu-check on {device['name']} ({device['memory_gib']} GiB), report: {args.output}", flush=True)

    fla_unavailable = device.get("fla_unavailable")

    if fla_unavailable is not None:
        print(f"warning: the fla configurations are skipped: fla cannot be used: {fla_unavailable}.", flush=True)

    ok = True

    if not args.skip_tests:
        timeout_s = min(TESTS_TIMEOUT_S, deadline - time.monotonic())

        print(f"CUDA tests: pytest -m cuda (at most {timeout_s:.0f} s)", flush=True)

        junit_path = args.output.with_name(args.output.stem + "_junit.xml")

        tests = run_tests(["-m", "cuda", "-q", "-rs", "tests"], junit_path, timeout_s)

        report["cuda_tests"] = tests

        write_report(report, args.output)

        print(f"CUDA tests: {tests['status']} in {tests['wall_s']:.0f} s, {tests.get('passed', '?')} passed, {tests.get('failed', '?')} failed, {tests.get('errors', '?')} errors, {tests.get('skipped', '?')} skipped", flush=True)

        ok = tests["status"] == "passed"

    ok = run_benchmarks(runs, deadline, report, args.output, fla_unavailable) and ok

    report["finished"] = _now()

    write_report(report, args.output)

    print(f"gpu-check {'passed' if ok else 'FAILED'}; report: {args.output}", flush=True)

    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
