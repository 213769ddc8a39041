"""Unit tests of ``fairseq2 lm export_hf`` on fairseq2 checkpoints of a tiny
model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from hf_reference import read_safetensors_dir
from training_runs import write_scratch_run
import qwen35_fs2.cli.export_hf as export_cli
import qwen35_fs2.hf.export.checkpoint as export_checkpoint
from qwen35_fs2.cli.export_hf import main, parse_size
from qwen35_fs2.models.qwen35 import convert_qwen35_state_dict, create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scratch_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(autouse=True)
def keep_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    # `main` configures the process's logging, which would drop caplog's handler.
    monkeypatch.setattr(export_cli, "configure_logging", lambda no_rich: None)


def _errors(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


class TestMain:
    def test_exports_the_latest_step_of_a_run(self, run_dir: Path, tmp_path: Path) -> None:
        assert main([str(run_dir), str(tmp_path / "out")]) == 0

        tensors = read_safetensors_dir(tmp_path / "out")

        assert torch.equal(tensors["model.norm.weight"], torch.full((64,), 4.0))

        config = json.loads((tmp_path / "out" / "config.json").read_text())

        assert config["architectures"] == ["Qwen3_5ForCausalLM"]
        assert config["dtype"] == "float32"

        # The checkpoint's tensors, under their Hugging Face names.
        model = create_qwen35_model(tiny_qwen35_config())

        model.load_state_dict(convert_qwen35_state_dict(dict(tensors), tiny_qwen35_config()))

    @pytest.mark.parametrize("how", ["--step", "step_dir"])
    def test_exports_the_chosen_step(self, run_dir: Path, tmp_path: Path, how: str) -> None:
        if how == "--step":
            argv = [str(run_dir), str(tmp_path / "out"), "--step", "2"]
        else:
            argv = [str(run_dir / "checkpoints" / "step_2"), str(tmp_path / "out")]

        assert main(argv) == 0

        assert torch.equal(read_safetensors_dir(tmp_path / "out")["model.norm.weight"], torch.full((64,), 2.0))

    def test_writes_the_dtype_and_shard_size_asked_for(self, run_dir: Path, tmp_path: Path) -> None:
        assert main([str(run_dir), str(tmp_path / "out"), "--dtype", "bfloat16", "--max-shard-size", "50KB"]) == 0

        tensors = read_safetensors_dir(tmp_path / "out")

        assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
        assert len(list((tmp_path / "out").glob("*.safetensors"))) > 2

    def test_fails_for_a_checkpoint_directory_without_checkpoints(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        (tmp_path / "run" / "checkpoints").mkdir(parents=True)

        (tmp_path / "run" / "checkpoints" / "model.yaml").write_text("model_family: qwen35\n")

        assert main([str(tmp_path / "run"), str(tmp_path / "out")]) == 1

        assert "must hold at least one checkpoint (a step_N/model directory), but has none" in _errors(caplog)
        assert not (tmp_path / "out").exists()

    def test_fails_for_a_checkpoint_that_does_not_match_its_config(self, run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        checkpoint_dir = tmp_path / "checkpoints"

        checkpoint_dir.mkdir()

        (checkpoint_dir / "step_4").symlink_to(run_dir / "checkpoints" / "step_4")

        metadata = yaml.safe_load((run_dir / "checkpoints" / "model.yaml").read_text())

        metadata["model_config"]["model_dim"] = 32

        (checkpoint_dir / "model.yaml").write_text(yaml.safe_dump(metadata))

        assert main([str(checkpoint_dir), str(tmp_path / "out")]) == 1

        assert "is not compatible with the qwen35 model" in _errors(caplog)
        assert "decoder_frontend.embed.weight" in _errors(caplog)
        assert not (tmp_path / "out").exists()

    def test_fails_for_a_step_that_was_not_saved(self, run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        assert main([str(run_dir), str(tmp_path / "out"), "--step", "3"]) == 1

        assert "`--step` must be a step saved in" in _errors(caplog)
        assert "(2, 4), but is 3 instead" in _errors(caplog)

    @pytest.mark.parametrize("checkpoint", ["no_such_dir", "file.txt", "plain_dir"])
    def test_fails_for_what_is_no_checkpoint(self, tmp_path: Path, caplog: pytest.LogCaptureFixture, checkpoint: str) -> None:
        (tmp_path / "file.txt").write_text("x")
        (tmp_path / "plain_dir").mkdir()

        assert main([str(tmp_path / checkpoint), str(tmp_path / "out")]) == 1

        assert "CHECKPOINT must be" in _errors(caplog)
        assert not (tmp_path / "out").exists()

    def test_refuses_a_non_empty_output_directory_before_loading(self, run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "keep.txt").write_text("keep")

        monkeypatch.setattr(export_checkpoint, "_load_dtype", pytest.fail)

        assert main([str(run_dir), str(tmp_path / "out")]) == 1

        assert "Replace them with `--force`" in _errors(caplog)
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]

    def test_fails_for_a_read_only_output_location_and_leaves_nothing(self, run_dir: Path, read_only_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
        assert main([str(run_dir), str(read_only_dir / "out")]) == 1

        assert "The export cannot be written next to" in _errors(caplog)
        assert list(read_only_dir.iterdir()) == []

    def test_returns_2_for_a_usage_error(self, tmp_path: Path) -> None:
        assert main([str(tmp_path), str(tmp_path / "out"), "--dtype", "int8"]) == 2

        assert main([str(tmp_path), str(tmp_path / "out"), "--base", "x", "--no-base"]) == 2


class TestParseSize:
    @pytest.mark.parametrize(("value", "size"), [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1000", 1000), ("64 kb", 64_000)])
    def test_parses_sizes(self, value: str, size: int) -> None:
        assert parse_size(value) == size

    @pytest.mark.parametrize("value", ["0", "-1", "5TB", "GB", "1.5GB"])
    def test_rejects_other_values(self, value: str) -> None:
        with pytest.raises(Exception, match="SIZE must be a positive number of bytes"):
            parse_size(value)
