"""Unit tests of ``fairseq2 lm export_hf`` on fairseq2 checkpoints of a tiny
model, and of its hand-over from fairseq2's training-time exporter."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from fairseq2.checkpoint import StandardCheckpointManager, StandardModelMetadataDumper
from fairseq2.device import CPU
from fairseq2.gang import create_fake_gangs
from fairseq2.runtime.dependency import get_dependency_resolver, wire_object

from hf_reference import read_safetensors_dir
import qwen35_fs2.cli.export_hf as export_cli
import qwen35_fs2.hf.export.checkpoint as export_checkpoint
from qwen35_fs2.cli.export_hf import (
    hand_over_fairseq2_hg_export,
    install_hg_export_failure_filter,
    main,
    parse_size,
)
from qwen35_fs2.models.qwen35 import convert_qwen35_state_dict, create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training output directory with checkpoints of steps 2 and 4, written
    by fairseq2's checkpoint manager, of a model trained from scratch."""
    run_dir = tmp_path_factory.mktemp("run")

    resolver = get_dependency_resolver()

    config = tiny_qwen35_config()

    model = create_qwen35_model(config)

    manager = wire_object(resolver, StandardCheckpointManager, output_dir=run_dir, gangs=create_fake_gangs(CPU))

    for step_nr in (2, 4):
        with torch.no_grad():
            dict(model.named_parameters())["decoder.layer_norm.weight"].fill_(step_nr)

        manager.save_model_only(step_nr, model, blocking=True)

    wire_object(resolver, StandardModelMetadataDumper).dump(run_dir / "checkpoints", "qwen35", config)

    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"name": None, "path": None, "family": "qwen35", "arch": "qwen35_tiny"}}))

    return run_dir


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


class _Exec(Exception):
    pass


class TestHandOverFairseq2HgExport:
    @pytest.fixture
    def exec_calls(self, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
        calls: list[list[str]] = []

        def execv(path: str, args: list[str]) -> None:
            calls.append(args)

            raise _Exec()

        monkeypatch.setattr(export_cli.os, "execv", execv)

        return calls

    def _as_fairseq2_exporter(self, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
        main_module = types.ModuleType("__main__")

        main_module.__spec__ = types.SimpleNamespace(name="fairseq2.models.utils.hg_export")  # type: ignore[assignment]

        monkeypatch.setitem(sys.modules, "__main__", main_module)
        monkeypatch.setattr(sys, "argv", ["hg_export.py", *argv])

    def test_re_executes_fairseq2s_exporter_of_our_checkpoint_as_ours(self, run_dir: Path, monkeypatch: pytest.MonkeyPatch, exec_calls: list[list[str]]) -> None:
        checkpoint_dir = run_dir / "checkpoints"

        self._as_fairseq2_exporter(monkeypatch, ["--no-rich", "--checkpoint-dir", str(checkpoint_dir), "checkpoint_step_4", str(checkpoint_dir / "step_4" / "hg")])

        with pytest.raises(_Exec):
            hand_over_fairseq2_hg_export()

        assert exec_calls == [[sys.executable, "-m", "qwen35_fs2.cli.export_hf", str(checkpoint_dir), str(checkpoint_dir / "step_4" / "hg"), "--step", "4", "--no-rich"]]

    def test_leaves_other_processes_and_families_alone(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exec_calls: list[list[str]]) -> None:
        hand_over_fairseq2_hg_export()

        (tmp_path / "model.yaml").write_text("model_family: llama\n")

        self._as_fairseq2_exporter(monkeypatch, ["--checkpoint-dir", str(tmp_path), "checkpoint_step_4", str(tmp_path / "hg")])

        hand_over_fairseq2_hg_export()

        self._as_fairseq2_exporter(monkeypatch, ["qwen35_0.8b", str(tmp_path / "hg")])

        hand_over_fairseq2_hg_export()

        assert exec_calls == []


class TestHgExportFailureFilter:
    def test_turns_fairseq2s_warning_into_an_error_with_the_exporters_message(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        install_hg_export_failure_filter()
        install_hg_export_failure_filter()

        assert len(logging.getLogger("fairseq2").filters) == 1

        stderr_file = tmp_path / "hg.stderr"

        stderr_file.write_text("INFO: noise\n\n2026 ERROR: fairseq2 - Export failed: The base model must be ...\n")

        logger = logging.getLogger("fairseq2")

        with caplog.at_level(logging.INFO, logger="fairseq2"):
            logger.warning(f"Hugging Face export operation of step 7 failed. See operation output at {stderr_file}.")
            logger.warning("Something else.")

        failure, other = caplog.records[-2:]

        assert failure.levelno == logging.ERROR
        assert failure.getMessage().startswith(f"Hugging Face export of step 7 FAILED; the last lines of {stderr_file}:")
        assert "Export failed: The base model must be ..." in failure.getMessage()
        assert "noise" not in failure.getMessage()

        assert other.levelno == logging.WARNING
        assert other.getMessage() == "Something else."
