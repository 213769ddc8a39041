"""Unit tests of ``fairseq2 lm export_hf`` on fairseq2 checkpoints of a tiny
model."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from safetensors.torch import load_file, save_file

from hf_reference import read_safetensors_dir
from training_runs import LORA_RUN_CONFIG, write_lora_run, write_scratch_run
import qwen35_fs2.cli.export_hf as export_cli
import qwen35_fs2.hf.export.checkpoint as export_checkpoint
from qwen35_fs2.cli.export_hf import main, parse_size
from qwen35_fs2.hf.export import build_hf_config
from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from qwen35_fs2.lora import PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME
from qwen35_fs2.lora.checkpoint import LORA_BASE_FILE
from qwen35_fs2.models.qwen35 import convert_qwen35_state_dict, create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scratch_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def lora_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lora_run(tmp_path_factory.mktemp("lora_run"))


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

        assert main([str(checkpoint_dir), str(tmp_path / "out"), "--no-base"]) == 1

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

    def test_ships_the_tokenizer_when_the_base_holds_none(self, run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        # A base as fairseq2 downloads a Hub model: its config and weights
        # alone.
        config = tiny_qwen35_config()

        base_dir = tmp_path / "base"

        base_dir.mkdir()

        hf_config = build_hf_config(config, base=None, text_only=True, dtype=torch.float32, num_mtp_layers=0)

        (base_dir / "config.json").write_text(json.dumps(hf_config))

        hg = to_hg_state_dict(create_qwen35_model(config).state_dict(), config)

        save_file({k: v.contiguous() for k, v in hg.items() if isinstance(v, torch.Tensor)}, str(base_dir / "model.safetensors"))

        tokenizer_dir = tmp_path / "tokenizer"

        tokenizer_dir.mkdir()

        (tokenizer_dir / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 7, "content": "<|endoftext|>"}, {"id": 9, "content": "<|im_end|>"}]}))
        (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))

        assert main([str(run_dir), str(tmp_path / "out"), "--base", str(base_dir), "--tokenizer", str(tokenizer_dir)]) == 0, _errors(caplog)

        out_files = sorted(p.name for p in (tmp_path / "out").iterdir())

        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(out_files), out_files

        assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == [9, 7]

        # A base with a tokenizer carries its own over.
        (base_dir / "tokenizer.json").write_text("{}")

        assert main([str(run_dir), str(tmp_path / "out2"), "--base", str(base_dir), "--tokenizer", str(tokenizer_dir)]) == 1

        assert f"`--tokenizer` is for exports without a base model, or with a base that holds no tokenizer, but {base_dir} holds one, which is carried over." in _errors(caplog)

    def test_exports_a_run_named_by_a_relative_path(self, run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
        # As docs/export.md writes the command (`export_hf runs/sft ...`).
        monkeypatch.chdir(run_dir.parent)

        assert main([run_dir.name, str(tmp_path / "out")]) == 0, _errors(caplog)

        assert main([f"{run_dir.name}/checkpoints/step_2", str(tmp_path / "out2")]) == 0, _errors(caplog)

    def test_exports_a_run_whose_checkpoints_are_a_link(self, run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        # The checkpoints on scratch storage, linked from the run's directory,
        # which holds its config.yaml.
        shutil.copytree(run_dir / "checkpoints", tmp_path / "scratch" / "checkpoints")

        (tmp_path / "run").mkdir()

        shutil.copy(run_dir / "config.yaml", tmp_path / "run")

        (tmp_path / "run" / "checkpoints").symlink_to(tmp_path / "scratch" / "checkpoints")

        assert main([str(tmp_path / "run" / "checkpoints"), str(tmp_path / "out")]) == 0, _errors(caplog)

    def test_checkpoints_away_from_their_run_need_the_base_named(self, run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        # Written with `--checkpoint-dir` outside the run's directory: the
        # run's config.yaml, which records its base, is not above them.
        checkpoint_dir = tmp_path / "elsewhere" / "ckpts"

        shutil.copytree(run_dir / "checkpoints", checkpoint_dir)

        assert main([str(checkpoint_dir), str(tmp_path / "out")]) == 1

        assert f"must have the config.yaml of their run in {tmp_path / 'elsewhere'}, which records the model the run started from and its tokenizer, but have none there" in _errors(caplog)

        assert not (tmp_path / "out").exists()

        assert main([str(checkpoint_dir), str(tmp_path / "out"), "--no-base"]) == 0, _errors(caplog)

        # Or the run's directory named.
        assert main([str(checkpoint_dir), str(tmp_path / "out2"), "--run-dir", str(run_dir)]) == 0, _errors(caplog)

        assert main([str(run_dir), str(tmp_path / "out3"), "--run-dir", str(run_dir)]) == 0, _errors(caplog)

    def test_fails_for_a_read_only_output_location_and_leaves_nothing(self, run_dir: Path, read_only_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
        assert main([str(run_dir), str(read_only_dir / "out")]) == 1

        assert "The export cannot be written next to" in _errors(caplog)
        assert list(read_only_dir.iterdir()) == []

    def test_returns_2_for_a_usage_error(self, tmp_path: Path) -> None:
        assert main([str(tmp_path), str(tmp_path / "out"), "--dtype", "int8"]) == 2

        assert main([str(tmp_path), str(tmp_path / "out"), "--base", "x", "--no-base"]) == 2

        assert main([str(tmp_path), str(tmp_path / "out"), "--adapter", "--merge"]) == 2


class TestLoraRuns:
    def test_merge_adds_each_update_to_its_weight_in_float32_then_casts(self, lora_run_dir: Path, tmp_path: Path) -> None:
        assert main([str(lora_run_dir), str(tmp_path / "out"), "--merge", "--dtype", "bfloat16"]) == 0

        config = tiny_qwen35_config()

        exported = convert_qwen35_state_dict(dict(read_safetensors_dir(tmp_path / "out")), config)

        # The checkpoint file (the adapters alone) and the base, read
        # without the export's loader.
        saved = torch.load(lora_run_dir / "checkpoints" / "step_2" / "model" / "pp_00" / "tp_00" / "sdp_00.pt", map_location="cpu", weights_only=True)

        assert all(".lora." in key for key in saved)

        base = convert_qwen35_state_dict(load_file(lora_run_dir / "base" / "model.safetensors"), config)

        scaling = LORA_RUN_CONFIG.alpha / LORA_RUN_CONFIG.r

        expected = {key: tensor for key, tensor in base.items() if isinstance(tensor, torch.Tensor)}

        num_merged = 0

        for key in list(expected):
            a_key = key.removesuffix("weight") + "lora.a_proj.weight"

            if a_key in saved:
                b = saved[key.removesuffix("weight") + "lora.b_proj.weight"]

                expected[key] = expected[key] + (b @ saved[a_key]) * scaling

                num_merged += 1

        # q_proj and o_proj of the attention layer, in_proj_qkv and in_proj_a
        # of the three Gated DeltaNet layers, down_proj of all four.
        assert num_merged == 2 + 2 * 3 + 4

        assert exported.keys() == expected.keys()

        for key, tensor in expected.items():
            assert torch.equal(exported[key], tensor.to(torch.bfloat16)), key

    def test_adapter_writes_the_peft_adapter_without_a_base(self, lora_run_dir: Path, tmp_path: Path) -> None:
        assert main([str(lora_run_dir), str(tmp_path / "out"), "--adapter"]) == 0

        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME])

        peft_config = json.loads((tmp_path / "out" / PEFT_CONFIG_NAME).read_text())

        assert peft_config["base_model_name_or_path"] is None
        assert (peft_config["r"], peft_config["lora_alpha"]) == (LORA_RUN_CONFIG.r, LORA_RUN_CONFIG.alpha)
        assert peft_config["target_modules"] == sorted(LORA_RUN_CONFIG.target_modules)

        tensors = load_file(tmp_path / "out" / PEFT_WEIGHTS_NAME)

        assert len(tensors) == 2 * (2 + 2 * 3 + 4)
        assert "base_model.model.model.layers.3.self_attn.o_proj.lora_B.weight" in tensors

    def test_fails_for_a_lora_run_without_adapter_or_merge(self, lora_run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        assert main([str(lora_run_dir), str(tmp_path / "out")]) == 1

        assert "is the checkpoint of a LoRA run, so it must be exported with `--adapter`" in _errors(caplog)
        assert not (tmp_path / "out").exists()

    @pytest.mark.parametrize("flag", ["--adapter", "--merge"])
    def test_fails_for_adapter_or_merge_on_a_run_without_lora(self, run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, flag: str) -> None:
        assert main([str(run_dir), str(tmp_path / "out"), flag]) == 1

        assert f"CHECKPOINT must be of a LoRA run (with a `lora` section in its config.yaml) to be exported with `{flag}`, but step 4 of" in _errors(caplog)
        assert not (tmp_path / "out").exists()

    def test_a_record_left_by_a_lora_run_without_checkpoints_is_ignored(self, run_dir: Path, lora_run_dir: Path, tmp_path: Path) -> None:
        # A LoRA run stopped before its first checkpoint, then a full run in
        # the same directory: its config.yaml has no `lora` section.
        other = tmp_path / "run"

        other.mkdir()

        (other / "config.yaml").symlink_to(run_dir / "config.yaml")

        (other / "checkpoints").mkdir()

        for path in (run_dir / "checkpoints").iterdir():
            (other / "checkpoints" / path.name).symlink_to(path)

        (other / "checkpoints" / LORA_BASE_FILE).symlink_to(lora_run_dir / "checkpoints" / LORA_BASE_FILE)

        assert main([str(other), str(tmp_path / "out")]) == 0

        assert torch.equal(read_safetensors_dir(tmp_path / "out")["model.norm.weight"], torch.full((64,), 4.0))

    def test_fails_for_a_lora_run_without_the_record_of_its_base_and_adapters(self, lora_run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        run_dir = tmp_path / "run"

        (run_dir / "checkpoints").mkdir(parents=True)

        (run_dir / "config.yaml").symlink_to(lora_run_dir / "config.yaml")

        for name in ("model.yaml", "step_2"):
            (run_dir / "checkpoints" / name).symlink_to(lora_run_dir / "checkpoints" / name)

        assert main([str(run_dir), str(tmp_path / "out"), "--adapter"]) == 1

        assert f"must have a record of the base model their LoRA adapters adapt ({LORA_BASE_FILE}), but have none." in _errors(caplog)
        assert not (tmp_path / "out").exists()


class TestParseSize:
    @pytest.mark.parametrize(("value", "size"), [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1000", 1000), ("64 kb", 64_000)])
    def test_parses_sizes(self, value: str, size: int) -> None:
        assert parse_size(value) == size

    @pytest.mark.parametrize("value", ["0", "-1", "5TB", "GB", "1.5GB"])
    def test_rejects_other_values(self, value: str) -> None:
        with pytest.raises(Exception, match="SIZE must be a positive number of bytes"):
            parse_size(value)
