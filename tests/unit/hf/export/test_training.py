"""The training-time exporter: ``fairseq2 lm export_hf`` of a saved step, in
a subprocess on rank 0, with its command line and output next to the
export, and a failure as an error in the log."""

from __future__ import annotations

import logging
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fairseq2.device import CPU
from fairseq2.gang import FakeGang, Gangs, create_fake_gangs

from hf_reference import read_safetensors_dir
from training_runs import write_lora_run, write_scratch_run
from qwen35_fs2.hf.export.training import HfCheckpointExporter


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scratch_run(tmp_path_factory.mktemp("run"))


class TestHfCheckpointExporter:
    def test_exports_the_step_with_the_export_command(self, run_dir: Path) -> None:
        checkpoint_dir = run_dir / "checkpoints"

        exporter = HfCheckpointExporter(checkpoint_dir, create_fake_gangs(CPU), run_dir=run_dir)

        exporter.export(2)

        assert exporter.wait() is True

        step_dir = checkpoint_dir / "step_2"

        assert shlex.split((step_dir / "hg.run").read_text()) == [
            sys.executable, "-m", "qwen35_fs2.cli.export_hf", str(checkpoint_dir), str(step_dir / "hg"), "--step", "2", "--run-dir", str(run_dir), "--no-rich",
        ]  # fmt: skip

        # The checkpoint of step 2, not the latest one.
        tensors = read_safetensors_dir(step_dir / "hg")

        assert torch.equal(tensors["model.norm.weight"], torch.full((64,), 2.0))

        assert (step_dir / "hg.stdout").is_file()

        assert exporter.wait() is None

    def test_exports_checkpoints_kept_away_from_their_run(self, run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        # `--checkpoint-dir` elsewhere: the run's config.yaml, which records
        # its base and tokenizer, is in the run's output directory.
        checkpoint_dir = tmp_path / "elsewhere" / "checkpoints"

        # Without the exports of the other tests.
        shutil.copytree(run_dir / "checkpoints", checkpoint_dir, ignore=shutil.ignore_patterns("hg*"))

        exporter = HfCheckpointExporter(checkpoint_dir, create_fake_gangs(CPU), run_dir=run_dir)

        exporter.export(2)

        assert exporter.wait() is True, [r.getMessage() for r in caplog.records]

        assert torch.equal(read_safetensors_dir(checkpoint_dir / "step_2" / "hg")["model.norm.weight"], torch.full((64,), 2.0))

    def test_exports_a_lora_run_as_a_peft_adapter(self, tmp_path: Path) -> None:
        checkpoint_dir = write_lora_run(tmp_path) / "checkpoints"

        exporter = HfCheckpointExporter(checkpoint_dir, create_fake_gangs(CPU), run_dir=tmp_path, adapter=True)

        exporter.export(2)

        assert exporter.wait() is True

        export_dir = checkpoint_dir / "step_2" / "hg"

        assert shlex.split((checkpoint_dir / "step_2" / "hg.run").read_text())[-1] == "--adapter"

        assert {p.name for p in export_dir.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}

        assert all(".lora_" in key for key in read_safetensors_dir(export_dir))

    def test_logs_a_failure_with_the_commands_error_and_exit_status(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        # A checkpoint directory without checkpoints.
        checkpoint_dir = tmp_path / "checkpoints"

        (checkpoint_dir / "step_3").mkdir(parents=True)

        (checkpoint_dir / "model.yaml").write_text("model_family: qwen35\n")

        exporter = HfCheckpointExporter(checkpoint_dir, create_fake_gangs(CPU), run_dir=tmp_path)

        with caplog.at_level(logging.INFO, logger="fairseq2"):
            exporter.export(3)

            assert exporter.wait() is False

        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

        assert len(errors) == 1

        stderr_file = checkpoint_dir / "step_3" / "hg.stderr"

        assert errors[0].startswith(f"Hugging Face export of step 3 FAILED (exit status 1); the last lines of {stderr_file}:")
        assert "must hold at least one checkpoint (a step_N/model directory), but has none" in errors[0]

        assert not (checkpoint_dir / "step_3" / "hg").exists()

    def test_exports_nothing_on_other_ranks(self, run_dir: Path) -> None:
        gang = FakeGang(CPU, rank=1, size=2)

        gangs = Gangs(root=gang, dp=gang, rdp=gang, sdp=gang, tp=gang, pp=gang)

        exporter = HfCheckpointExporter(run_dir / "checkpoints", gangs, run_dir=run_dir)

        exporter.export(4)

        assert exporter.wait() is None

        assert not (run_dir / "checkpoints" / "step_4" / "hg.run").exists()
