"""The suite's set-up for pytest-xdist (``tests/parallel_runs.py``,
``tests/xdist_units.py``) and its clock of work units (``tests/unit_clock.py``),
run on a suite of its own: a nested pytest on two workers whose tests record
when, where and with how many threads they ran."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Final

import pytest

TESTS_DIR: Final = Path(__file__).resolve().parents[1]

CONFTEST: Final = """\
import json
import os
import time

import pytest
import torch

from parallel_runs import _alone_modules_run_alone as _alone_modules_run_alone
from parallel_runs import pytest_collection_modifyitems as pytest_collection_modifyitems
from parallel_runs import pytest_configure as pytest_configure
from parallel_runs import pytest_configure_node as pytest_configure_node
from parallel_runs import pytest_unconfigure as pytest_unconfigure
from parallel_runs import pytest_xdist_make_scheduler as pytest_xdist_make_scheduler
from unit_clock import pytest_addoption as pytest_addoption
from unit_clock import pytest_sessionstart as pytest_sessionstart


@pytest.fixture
def record(request):
    def sleep_and_record(seconds):
        start = time.monotonic()

        time.sleep(seconds)

        entry = {
            "test": request.node.nodeid,
            "worker": os.environ.get("PYTEST_XDIST_WORKER"),
            "start": start,
            "end": time.monotonic(),
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }

        with open(os.environ["RECORD_FILE"], "a") as file:
            file.write(json.dumps(entry) + "\\n")

    return sleep_and_record
"""


def _test_module(num_tests: int, seconds: float, marks: str = "", fixture_seconds: float = 0.0) -> str:
    """A test module whose tests sleep, after a module fixture that sleeps."""
    fixture = f"\n\n@pytest.fixture(scope='module', autouse=True)\ndef module_fixture():\n    time.sleep({fixture_seconds})\n"

    tests = "".join(f"\n\ndef test_{i}(record):\n    record({seconds})\n" for i in range(num_tests))

    return f"import time\n\nimport pytest\n{marks}{fixture}{tests}"


def _run_pytest(root: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, object]]]:
    record_file = root / "record.jsonl"

    # What the outer run set for its own workers must not leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "OMP_NUM_THREADS"}

    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *filter(None, [env.get("PYTHONPATH")])])

    env["RECORD_FILE"] = str(record_file)

    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip

    records = [json.loads(line) for line in record_file.read_text().splitlines()] if record_file.exists() else []

    return process, records


def _write_suite(root: Path, modules: dict[str, str]) -> None:
    # Every unit is long enough for the clock to print it.
    root.joinpath("pytest.ini").write_text(
        "[pytest]\naddopts = --strict-markers\nunit_clock_min_seconds = 0\nmarkers =\n    slow: a long test\n"
    )

    root.joinpath("conftest.py").write_text(CONFTEST)

    for name, source in modules.items():
        path = root / name

        path.parent.mkdir(parents=True, exist_ok=True)

        path.write_text(source)


@pytest.mark.slow
class TestParallelRuns:
    def test_two_workers_keep_units_together_and_run_an_alone_module_by_itself(self, tmp_path: Path) -> None:
        # Handed out first, the alone module and the slow one start side by
        # side unless the lock keeps them apart.
        _write_suite(
            tmp_path,
            {
                "tests/slurm/test_cluster_a.py": _test_module(2, 0.3),
                "tests/slurm/test_cluster_b.py": _test_module(2, 0.3),
                "tests/test_a.py": _test_module(1, 0.5),
                "tests/test_b.py": _test_module(1, 0.5),
                "tests/test_c.py": _test_module(1, 0.5),
                "tests/test_d.py": _test_module(1, 0.5),
                "tests/test_heavy.py": _test_module(3, 1.0, "\npytestmark = pytest.mark.alone\n"),
                "tests/test_long.py": _test_module(1, 0.5, "\npytestmark = pytest.mark.slow\n", fixture_seconds=1.0),
            },
        )

        process, records = _run_pytest(tmp_path, "-n", "2", "--dist", "loadfile", "tests")

        assert process.returncode == 0, process.stdout + process.stderr

        assert len(records) == 12, records

        # One thread a worker, for the processes it starts too.
        assert {(r["threads"], r["omp_num_threads"]) for r in records} == {(1, "1")}

        def workers_of(prefix: str) -> set[object]:
            return {r["worker"] for r in records if str(r["test"]).startswith(prefix)}

        assert workers_of("tests/") == {"gw0", "gw1"}

        # The SLURM files on one worker, each other file on one worker.
        assert len(workers_of("tests/slurm/")) == 1

        for name in ("a", "b", "c", "d", "heavy", "long"):
            assert len(workers_of(f"tests/test_{name}.py")) == 1

        def start_of(prefix: str) -> float:
            return min(float(r["start"]) for r in records if str(r["test"]).startswith(prefix))  # type: ignore[arg-type]

        # The slow module, collected last, is handed out before the fast ones
        # (xdist's own order, the units of the most tests first, hands it out
        # last): its worker starts with it.
        (long_worker,) = workers_of("tests/test_long.py")

        assert min((r for r in records if r["worker"] == long_worker), key=lambda r: float(r["start"]))["test"] == "tests/test_long.py::test_0"  # type: ignore[arg-type]

        heavy = [r for r in records if str(r["test"]).startswith("tests/test_heavy.py")]

        heavy_start = start_of("tests/test_heavy.py")

        heavy_end = max(float(r["end"]) for r in heavy)  # type: ignore[arg-type]

        beside = [r["test"] for r in records if r not in heavy and float(r["start"]) < heavy_end and float(r["end"]) > heavy_start]  # type: ignore[arg-type]

        assert not beside, f"{beside} ran beside tests/test_heavy.py"

        # The clock's line for each unit, on the unit's worker, at least as
        # long as the unit's sleeps, its module fixture's included.
        units = _clock_lines(process.stdout)

        sleeps = {"tests/slurm/": (4, 1.2), "tests/test_heavy.py": (3, 3.0), "tests/test_long.py": (1, 1.5)}

        sleeps |= {f"tests/test_{name}.py": (1, 0.5) for name in "abcd"}

        assert sorted(units) == sorted(sleeps), process.stdout

        for name, (num_tests, seconds) in sleeps.items():
            worker, unit_tests, unit_seconds = units[name]

            assert {worker} == workers_of(name)

            assert unit_tests == num_tests

            assert unit_seconds >= seconds, (name, unit_seconds)

        # The summary: the units again, the longest first.
        summary = _clock_summary(process.stdout)

        assert sorted(name for name, _ in summary) == sorted(units), process.stdout

        assert [seconds for _, seconds in summary] == sorted((seconds for _, seconds in summary), reverse=True)

        assert all(seconds == units[name][2] for name, seconds in summary)

    def test_a_serial_run_keeps_its_threads(self, tmp_path: Path) -> None:
        _write_suite(tmp_path, {"tests/test_a.py": _test_module(1, 0.0)})

        process, records = _run_pytest(tmp_path, "tests")

        assert process.returncode == 0, process.stdout + process.stderr

        assert [(r["threads"], r["omp_num_threads"]) for r in records] == [(torch_default_threads(), None)]

        units = _clock_lines(process.stdout)

        assert list(units) == ["tests/test_a.py"], process.stdout

        assert units["tests/test_a.py"][:2] == ("serial", 1)

    def test_a_unit_clock_threshold_that_is_no_number_is_refused(self, tmp_path: Path) -> None:
        _write_suite(tmp_path, {"tests/test_a.py": _test_module(1, 0.0)})

        process, records = _run_pytest(tmp_path, "-o", "unit_clock_min_seconds=soon", "tests")

        assert process.returncode == pytest.ExitCode.USAGE_ERROR, process.stdout + process.stderr

        assert "`unit_clock_min_seconds` must be a number of seconds, but is 'soon' instead." in process.stderr

        assert not records

    def test_alone_on_a_test_function_is_refused(self, tmp_path: Path) -> None:
        source = textwrap.dedent(
            """\
            import pytest


            @pytest.mark.alone
            def test_0(record):
                record(0.0)
            """
        )

        _write_suite(tmp_path, {"tests/test_a.py": source})

        process, _ = _run_pytest(tmp_path, "tests")

        assert process.returncode == pytest.ExitCode.USAGE_ERROR, process.stdout + process.stderr

        assert "`alone` must mark a whole module (its `pytestmark`), but marks tests/test_a.py::test_0 only instead." in process.stderr


_CLOCK_LINE: Final = re.compile(r"^\[\d\d:\d\d:\d\d\] (\S+) ran (\S+) \((\d+) tests\) in (\d+\.\d) s$", re.MULTILINE)

_SUMMARY_LINE: Final = re.compile(r"^ *(\d+\.\d) s  \S+  (\S+) \(\d+ tests\)$", re.MULTILINE)


def _clock_lines(output: str) -> dict[str, tuple[str, int, float]]:
    """The unit clock's lines: the worker, the number of tests and the
    seconds of each unit, which must have one line."""
    units: dict[str, tuple[str, int, float]] = {}

    for worker, name, num_tests, seconds in _CLOCK_LINE.findall(output):
        assert name not in units, f"two lines for {name}"

        units[name] = (worker, int(num_tests), float(seconds))

    return units


def _clock_summary(output: str) -> list[tuple[str, float]]:
    """The units and their seconds in the clock's summary, in its order."""
    _, found, summary = output.partition("longest work units (of 0 s or more)")

    assert found, output

    return [(name, float(seconds)) for seconds, name in _SUMMARY_LINE.findall(summary)]


def torch_default_threads() -> int:
    """PyTorch's thread count in a fresh process without ``OMP_NUM_THREADS``."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

    process = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env, capture_output=True, text=True, check=True
    )  # fmt: skip

    return int(process.stdout)
