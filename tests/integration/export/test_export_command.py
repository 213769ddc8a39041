"""``fairseq2 lm export_hf`` on training runs, and training-time export
through the recipes' exporter (a subprocess with an empty environment)."""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn import Module

from fairseq2.device import CPU
from fairseq2.gang import create_fake_gangs
from fairseq2.runtime.dependency import get_dependency_resolver
from fairseq2.utils.structured import ValueConverter

import qwen35_fs2.cli.export_hf as export_cli
from export_testing import DENSE_VLM, DENSE_VLM_WIDE, INPUT_IDS, MOE_VLM, fairseq2_logits, make_training_run
from hf_reference import HfReferenceBatch, TinyQwen35Spec, read_safetensors_dir
from qwen35_fs2.cli.export_hf import main
from qwen35_fs2.hf.export.training import HfCheckpointExporter
from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from qwen35_fs2.hf.config import qwen35_config_from_hf
from qwen35_fs2.hf.config import load_hf_config

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def keep_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    # `main` configures the process's logging, which would drop caplog's handler.
    monkeypatch.setattr(export_cli, "configure_logging", lambda no_rich: None)


@pytest.fixture(scope="module")
def runs(base_dirs: dict[TinyQwen35Spec, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[TinyQwen35Spec, tuple[Path, Path, dict[int, Module]]]:
    """A training run (steps 2 and 4) started from a copy, with a tokenizer,
    of each of the dense and the MoE released-layout checkpoints."""
    runs = {}

    for spec in (DENSE_VLM, MOE_VLM):
        base_dir = tmp_path_factory.mktemp("base") / "hf"

        shutil.copytree(base_dirs[spec], base_dir)

        (base_dir / "tokenizer.json").write_text('{"version": "1.0"}')

        run_dir = tmp_path_factory.mktemp("run")

        runs[spec] = (run_dir, base_dir, make_training_run(run_dir, base_dir))

    return runs


@pytest.mark.parametrize("spec", [DENSE_VLM, MOE_VLM], ids=["dense", "moe"])
def test_exports_the_fine_tuned_weights_of_the_latest_step_with_the_base_carried_over(spec: TinyQwen35Spec, runs: dict[TinyQwen35Spec, tuple[Path, Path, dict[int, Module]]], tmp_path: Path) -> None:
    run_dir, base_dir, models = runs[spec]

    assert main([str(run_dir), str(tmp_path / "out")]) == 0

    exported = read_safetensors_dir(tmp_path / "out")
    base = read_safetensors_dir(base_dir)

    assert exported.keys() == base.keys()

    config = qwen35_config_from_hf(load_hf_config(base_dir))

    trained = to_hg_state_dict(models[4].state_dict(), config)

    for key, tensor in exported.items():
        if key.startswith(("model.visual.", "mtp.")):
            assert torch.equal(tensor, base[key]), key
        elif "mlp.experts." not in key:
            text_key = key.replace("model.language_model.", "model.")

            trained_tensor = trained[text_key]

            assert isinstance(trained_tensor, torch.Tensor)

            assert torch.equal(tensor, trained_tensor), key

            assert not torch.equal(tensor, base[key]), f"{key} is the base's, not the fine-tuned one"

    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'

    batch = HfReferenceBatch()

    logits = batch.logits(tmp_path / "out", INPUT_IDS, model_class="conditional_generation")

    batch.run()

    assert (logits.result() - fairseq2_logits(models[4])).abs().max().item() <= 2e-5


def test_fails_for_a_base_of_another_architecture_and_leaves_nothing(runs: dict[TinyQwen35Spec, tuple[Path, Path, dict[int, Module]]], base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_dir, _, _ = runs[DENSE_VLM]

    ret = main([str(run_dir), str(tmp_path / "out"), "--base", str(base_dirs[DENSE_VLM_WIDE])])

    assert ret == 1

    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

    assert len(errors) == 1
    assert "must have the architecture of the exported model" in errors[0]
    assert "hidden_size (base: 96, model: 64)" in errors[0]

    assert list(tmp_path.iterdir()) == []


def test_exports_an_asset_card_and_takes_one_as_base(runs: dict[TinyQwen35Spec, tuple[Path, Path, dict[int, Module]]], tmp_path: Path) -> None:
    run_dir, base_dir, _ = runs[DENSE_VLM]

    config = qwen35_config_from_hf(load_hf_config(base_dir))

    card = {
        "name": "tiny_qwen35_base",
        "model_family": "qwen35",
        "model_config": get_dependency_resolver().resolve(ValueConverter).unstructure(config),  # type: ignore[type-abstract]
        "checkpoint": f"file://{base_dir}",
    }

    (tmp_path / "assets").mkdir()

    (tmp_path / "assets" / "tiny.yaml").write_text(yaml.safe_dump(card))

    env = {**os.environ, "FAIRSEQ2_USER_ASSET_DIR": str(tmp_path / "assets")}

    def export(*args: str) -> None:
        command = [sys.executable, "-m", "qwen35_fs2.cli.export_hf", *args, "--no-rich"]

        result = subprocess.run(command, env=env, capture_output=True, text=True)

        assert result.returncode == 0, result.stderr

    # The card's checkpoint is the base: the export reproduces it.
    export("tiny_qwen35_base", str(tmp_path / "card"))

    expected = read_safetensors_dir(base_dir)
    actual = read_safetensors_dir(tmp_path / "card")

    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[k], v) for k, v in expected.items())

    export(str(run_dir), str(tmp_path / "run"), "--base", "tiny_qwen35_base", "--step", "2")

    assert read_safetensors_dir(tmp_path / "run").keys() == expected.keys()
    assert (tmp_path / "run" / "tokenizer.json").is_file()


def _export_like_the_trainer(run_dir: Path, step_nr: int) -> list[int]:
    """Runs the recipes' training-time exporter as their trainer does (a
    subprocess with an empty environment); returns the steps exported."""
    exporter = HfCheckpointExporter(run_dir / "checkpoints", create_fake_gangs(CPU), run_dir=run_dir)

    exporter.export(step_nr)

    return [step_nr] if exporter.wait() else []


def test_training_time_export_writes_what_the_command_writes(runs: dict[TinyQwen35Spec, tuple[Path, Path, dict[int, Module]]], tmp_path: Path) -> None:
    run_dir, _, _ = runs[DENSE_VLM]

    assert _export_like_the_trainer(run_dir, 2) == [2]

    assert main([str(run_dir), str(tmp_path / "out"), "--step", "2"]) == 0

    hg_dir = run_dir / "checkpoints" / "step_2" / "hg"

    names = sorted(p.name for p in hg_dir.iterdir())

    assert names == sorted(p.name for p in (tmp_path / "out").iterdir())

    for name in names:
        assert (hg_dir / name).read_bytes() == (tmp_path / "out" / name).read_bytes(), name

    assert "qwen35_fs2.cli.export_hf" in (run_dir / "checkpoints" / "step_2" / "hg.run").read_text()


def test_failed_training_time_export_is_an_error_in_the_log_and_the_exit_status(runs: dict[TinyQwen35Spec, tuple[Path, Path, dict[int, Module]]], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source_dir, _, _ = runs[DENSE_VLM]

    run_dir = tmp_path / "run"

    (run_dir / "checkpoints" / "step_4").mkdir(parents=True)

    (run_dir / "checkpoints" / "model.yaml").write_bytes((source_dir / "checkpoints" / "model.yaml").read_bytes())

    (run_dir / "checkpoints" / "step_4" / "model").symlink_to(source_dir / "checkpoints" / "step_4" / "model")

    # The base the run started from is gone.
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "gone"), "family": "qwen35"}}))

    with caplog.at_level(logging.WARNING, logger="fairseq2"):
        assert _export_like_the_trainer(run_dir, 4) == []

    step_dir = run_dir / "checkpoints" / "step_4"

    assert sorted(p.name for p in step_dir.iterdir()) == ["hg.run", "hg.stderr", "hg.stdout", "model"]

    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

    assert len(errors) == 1
    assert errors[0].startswith("Hugging Face export of step 4 FAILED")
    assert f"started from {tmp_path / 'gone'}" in errors[0]

    # The command line, as the exporter records it, fails in an empty environment.
    command = shlex.split((step_dir / "hg.run").read_text())

    result = subprocess.run(command, env={}, capture_output=True, text=True)

    assert result.returncode == 1
    assert "does not exist anymore" in result.stderr
    assert not (step_dir / "hg").exists()
