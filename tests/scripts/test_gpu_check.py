"""``scripts/gpu_check.py`` (``make gpu-check``) on a machine without a GPU:
it refuses to start, its configurations are valid options of the
benchmarks, and its report keeps going past a configuration that fails,
runs out of time or would start after its budget, with real benchmark
runs on CPU standing in for the CUDA ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402
import train_step  # noqa: E402
import train_step_moe  # noqa: E402
from gpu_check import BenchmarkRun  # noqa: E402

# A real failure of a real benchmark: its option check refuses fla on CPU.
_FAILING = BenchmarkRun(
    name="moe fla on cpu",
    script="benchmarks/train_step_moe.py",
    options=("--backend=fla", "--variants=ours"),
    timeout_s=60,
)

# The matmul floor of a few tokens: the quickest real run (no model).
_PASSING = BenchmarkRun(
    name="dense floor",
    script="benchmarks/train_step.py",
    options=("--variants=floor", "--seq-len=16", "--num-warmup=0", "--num-steps=1"),
    timeout_s=120,
)


def _live_processes_with(marker: str) -> list[int]:
    """Returns the processes (not zombies) whose command line holds
    ``marker``."""
    pids = []

    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")

            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue

        if marker in cmdline and state != "Z":
            pids.append(int(proc.name))

    return pids


class TestGpuCheck:
    def test_refuses_to_start_without_a_cuda_device(self, tmp_path: Path) -> None:
        output = tmp_path / "report.json"

        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")

        result = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "gpu_check.py"), f"--output={output}"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

        assert result.returncode == 1

        assert "error: `make gpu-check` needs a CUDA device, but torch" in result.stderr

        assert "sees none (CUDA_VISIBLE_DEVICES: )" in result.stderr

        assert not output.exists()

    def test_configurations_are_valid_options_of_the_benchmarks(self) -> None:
        runs = gpu_check.gpu_check_runs()

        # Both models at both shapes, on both kernels, eager and compiled.
        assert len({run.name for run in runs}) == len(runs) == 16

        scripts = {"benchmarks/train_step.py": train_step, "benchmarks/train_step_moe.py": train_step_moe}

        for run in runs:
            parser = scripts[run.script].build_parser()

            args = parser.parse_args(run.options)

            assert train_step.check_run_options(parser, args) == (["floor", "ours"] if "floor" in args.variants else ["ours"])

            assert (args.device, args.dtype, args.compile) == ("cuda", "bf16", run.name.endswith("compiled"))

            assert args.shape in run.name and args.backend in run.name

        # Eager ones first, then compiled ones at the real shapes.
        assert [run.name.split()[-1] for run in runs] == ["eager"] * 8 + ["compiled"] * 8

        assert ["reference" in run.name for run in runs[8:]] == [False] * 4 + [True] * 4

    @pytest.mark.slow
    def test_report_records_a_failing_configuration_and_runs_the_others(self, tmp_path: Path) -> None:
        output = tmp_path / "report.json"

        report: dict[str, object] = {"benchmarks": []}

        ok = gpu_check.run_benchmarks([_FAILING, _PASSING], time.monotonic() + 600, report, output, fla_unavailable=None)

        assert not ok

        assert json.loads(output.read_text()) == report

        failing, passing = report["benchmarks"]  # type: ignore[misc]

        assert failing["status"] == "failed"

        assert "exit code 2" in failing["error"]

        assert "`--backend fla` needs `--device cuda`" in failing["error"]

        assert passing["status"] == "ok", passing.get("error")

        floor = passing["variants"]["floor"]

        assert floor["tokens_per_s"] == passing["benchmark"]["floor"]["tokens_per_s"] > 0

        # A CPU run has none of CUDA's numbers.
        assert floor["mfu"] is None and floor["peak_cuda_mib"] is None

    @pytest.mark.slow
    def test_a_configuration_out_of_time_is_killed_with_its_workers(self, tmp_path: Path) -> None:
        # The benchmark passes its options on to its worker, so this marks
        # both processes.
        marker = "--num-steps=918273"

        run = BenchmarkRun(name="slow", script="benchmarks/train_step.py", options=("--variants=floor", marker), timeout_s=60)

        entry = gpu_check.run_benchmark(run, timeout_s=3)

        assert entry["status"] == "timeout"

        assert entry["error"].startswith("ran out of its 3 s")

        # Killed is not yet gone.
        deadline = time.monotonic() + 10

        while _live_processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.1)

        survivors = _live_processes_with(marker)

        # Not left running when the test fails.
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)

        assert survivors == []

    def test_configurations_past_the_budget_are_not_run(self, tmp_path: Path) -> None:
        report: dict[str, object] = {"benchmarks": []}

        ok = gpu_check.run_benchmarks([_PASSING], time.monotonic() + 1, report, tmp_path / "report.json", fla_unavailable=None)

        assert not ok

        assert report["benchmarks"] == [
            {"name": "dense floor", "status": "not run", "error": "the check's time budget was spent."}
        ]

    def test_fla_configurations_are_skipped_with_the_reason_where_fla_cannot_train(self, tmp_path: Path) -> None:
        reason = "fla-core refuses to train on Hopper GPUs with Triton 3.6.0"

        report: dict[str, object] = {"benchmarks": []}

        # Skipped, not failed, and with no time left for the other one.
        assert gpu_check.run_benchmarks([_FAILING], time.monotonic() + 1, report, tmp_path / "report.json", fla_unavailable=reason)

        assert report["benchmarks"] == [{"name": "moe fla on cpu", "status": "skipped", "reason": f"fla cannot be used: {reason}."}]

        report = {"benchmarks": []}

        assert not gpu_check.run_benchmarks([_PASSING], time.monotonic() + 1, report, tmp_path / "report.json", fla_unavailable=reason)

        assert report["benchmarks"][0]["status"] == "not run"  # type: ignore[index]

    def test_device_query_reports_whether_fla_can_train(self) -> None:
        # No GPU here: the query runs with a made-up CUDA device in front of
        # it; fla's own check then sees no Hopper GPU.
        fake_device = (
            "import types, torch\n"
            "torch.cuda.is_available = lambda: True\n"
            "torch.cuda.device_count = lambda: 1\n"
            "torch.cuda.get_device_properties = lambda idx: types.SimpleNamespace(name='NVIDIA H200', major=9, minor=0, total_memory=150 * 2**30)\n"
        )

        output = subprocess.run(
            [sys.executable, "-c", fake_device + gpu_check._DEVICE_QUERY], capture_output=True, text=True, check=True
        ).stdout

        device = json.loads(output.strip().splitlines()[-1])

        assert device["name"] == "NVIDIA H200"

        assert "fla_unavailable" in device and device["fla_unavailable"] is None

    def test_test_results_are_counted_from_pytest_s_report(self, tmp_path: Path) -> None:
        (tmp_path / "test_sample.py").write_text(
            "import pytest\n"
            "\n"
            "pytestmark = pytest.mark.cuda\n"
            "\n"
            "def test_passes():\n"
            "    pass\n"
            "\n"
            "def test_fails():\n"
            "    raise AssertionError('one is not two')\n"
            "\n"
            "def test_skips():\n"
            "    pytest.skip('no reason')\n"
        )

        # The report names a test by its path from the rootdir, which would
        # otherwise depend on where the temporary directory lies relative to
        # the checkout.
        result = gpu_check.run_tests(
            ["-m", "cuda", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
            tmp_path / "junit.xml",
            timeout_s=120,
        )

        assert result["status"] == "failed" and result["exit_code"] == 1

        counts = {name: result[name] for name in ("tests", "passed", "failed", "errors", "skipped")}

        assert counts == {"tests": 3, "passed": 1, "failed": 1, "errors": 0, "skipped": 1}

        assert result["failing"] == [
            {"test": "test_sample::test_fails", "kind": "failure", "message": "AssertionError: one is not two"}
        ]

    def test_tests_that_all_skip_do_not_pass(self, tmp_path: Path) -> None:
        (tmp_path / "test_sample.py").write_text("import pytest\n\ndef test_skips():\n    pytest.skip('no GPU')\n")

        result = gpu_check.run_tests(["-q", "-p", "no:cacheprovider", str(tmp_path)], tmp_path / "junit.xml", timeout_s=120)

        assert (result["exit_code"], result["status"], result["skipped"]) == (0, "all skipped", 1)

    @pytest.mark.slow
    def test_main_writes_the_whole_report_and_fails_with_a_failing_configuration(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # No GPU here: the device check passes with a made-up device, and the
        # configurations are CPU runs.
        monkeypatch.setattr(gpu_check, "cuda_device", lambda: {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.1})
        monkeypatch.setattr(gpu_check, "gpu_check_runs", lambda: [_PASSING, _FAILING])

        output = tmp_path / "report.json"

        assert gpu_check.main([f"--output={output}", "--skip-tests"]) == 1

        report = json.loads(output.read_text())

        assert report["device"]["name"] == "NVIDIA H100 80GB HBM3"

        assert report["versions"]["torch"] == torch.__version__.split("+")[0]

        assert report["cuda_tests"] is None and report["finished"] is not None

        assert [entry["status"] for entry in report["benchmarks"]] == ["ok", "failed"]
