from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from fairseq2.error import StateDictError
from fairseq2.nn.data_parallel import get_data_parallel_facade

from qwen35_fs2.lora import LoraConfig, apply_lora
from qwen35_fs2.lora.checkpoint import (
    LORA_BASE_FILE,
    LoraBaseError,
    LoraCheckpointFacade,
    check_lora_base,
    check_lora_config,
    describe_lora_base,
    load_lora_base,
    save_lora_base,
)
from qwen35_fs2.models.qwen35 import create_qwen35_model, tiny_qwen35_config
from qwen35_fs2.nn.lora import LoraAdapter


def _save_base(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    path.mkdir()

    save_file({"model.embed_tokens.weight": torch.zeros((4, 2), dtype=dtype), "lm_head.weight": torch.ones((4, 2), dtype=dtype)}, str(path / "model.safetensors"))

    return path


_LORA = LoraConfig(target_modules=["q_proj", "out_proj"], r=4, alpha=8.0, dropout_p=0.1, rslora=True)


class TestLoraBase:
    def test_the_recorded_base_passes(self, tmp_path: Path) -> None:
        base = _save_base(tmp_path / "base")

        save_lora_base(tmp_path / "checkpoints", describe_lora_base(base, _LORA))

        recorded = load_lora_base(tmp_path / "checkpoints")

        assert recorded.path == base.resolve()

        assert recorded.lora == _LORA

        # Raises if the base were not the recorded one.
        check_lora_base(recorded, base)

    def test_a_base_in_another_directory_is_refused_even_if_identical(self, tmp_path: Path) -> None:
        base = _save_base(tmp_path / "base")

        other = tmp_path / "other"

        shutil.copytree(base, other)

        save_lora_base(tmp_path / "checkpoints", describe_lora_base(base, _LORA))

        with pytest.raises(LoraBaseError, match=rf"must be the one the LoRA adapters of the checkpoints were trained on, {base}, but is {other} instead\."):
            check_lora_base(load_lora_base(tmp_path / "checkpoints"), other)

    def test_a_base_changed_in_place_is_refused(self, tmp_path: Path) -> None:
        base = _save_base(tmp_path / "base")

        save_lora_base(tmp_path / "checkpoints", describe_lora_base(base, _LORA))

        # Re-saved in bf16 under the same name.
        shutil.rmtree(base)

        _save_base(base, torch.bfloat16)

        with pytest.raises(LoraBaseError, match="its safetensors have changed since"):
            check_lora_base(load_lora_base(tmp_path / "checkpoints"), base)

    @pytest.mark.parametrize(
        ("name", "value"),
        [("alpha", 16.0), ("rslora", False), ("r", 8), ("target_modules", ["q_proj"]), ("target_parameters", ["mlp.experts.down_proj"])],
    )
    def test_other_adapters_are_refused(self, tmp_path: Path, name: str, value: object) -> None:
        base = _save_base(tmp_path / "base")

        save_lora_base(tmp_path / "checkpoints", describe_lora_base(base, _LORA))

        recorded = load_lora_base(tmp_path / "checkpoints")

        with pytest.raises(LoraBaseError, match=rf"^`lora\.{name}` must be the one the LoRA adapters of the checkpoints were trained with, .*, but is .* instead\."):
            check_lora_config(recorded, replace(_LORA, **{name: value}))

    def test_another_dropout_is_accepted(self, tmp_path: Path) -> None:
        base = _save_base(tmp_path / "base")

        save_lora_base(tmp_path / "checkpoints", describe_lora_base(base, _LORA))

        recorded = load_lora_base(tmp_path / "checkpoints")

        assert recorded.lora.dropout_p == 0.1

        # Raises if the adapters were not the recorded ones.
        check_lora_config(recorded, replace(_LORA, dropout_p=0.0))

    def test_another_order_of_the_targets_is_accepted(self, tmp_path: Path) -> None:
        base = _save_base(tmp_path / "base")

        save_lora_base(tmp_path / "checkpoints", describe_lora_base(base, _LORA))

        recorded = load_lora_base(tmp_path / "checkpoints")

        assert recorded.lora.target_modules == ["q_proj", "out_proj"]

        # Raises if the adapters were not the recorded ones.
        check_lora_config(recorded, replace(_LORA, target_modules=["out_proj", "q_proj"]))

    def test_a_record_of_an_earlier_version_asks_for_the_adapters(self, tmp_path: Path) -> None:
        # As the record was before it held the adapters' settings.
        (tmp_path / LORA_BASE_FILE).write_text(yaml.safe_dump({"path": str(tmp_path), "fingerprint": "0" * 64}))

        with pytest.raises(LoraBaseError, match=r"must hold the `lora` configuration the adapters were trained with, but was written by an earlier version, which recorded the base alone\. Add the run's `lora` section to it"):
            load_lora_base(tmp_path)

    def test_a_record_of_invalid_adapters_is_an_error(self, tmp_path: Path) -> None:
        (tmp_path / LORA_BASE_FILE).write_text(yaml.safe_dump({"path": str(tmp_path), "fingerprint": "0" * 64, "lora": {"r": 0}}))

        with pytest.raises(LoraBaseError, match=r"must be one of LoRA adapters, but is not: .*`r` must be greater than 0"):
            load_lora_base(tmp_path)

    def test_a_missing_record_is_an_error(self, tmp_path: Path) -> None:
        with pytest.raises(LoraBaseError, match=rf"must have a record of the base model their LoRA adapters adapt \({LORA_BASE_FILE}\), but have none\."):
            load_lora_base(tmp_path)


def _lora_model(seed: int) -> torch.nn.Module:
    config = tiny_qwen35_config()

    torch.manual_seed(seed)

    model = create_qwen35_model(config)

    apply_lora(model, LoraConfig(target_modules=["q_proj", "in_proj_qkv", "down_proj"], r=2), config)

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraAdapter):
                module.b_proj.weight.normal_()

    return model


class TestLoraCheckpointFacade:
    def test_state_is_the_adapters_alone(self) -> None:
        model = _lora_model(seed=1)

        facade = LoraCheckpointFacade(get_data_parallel_facade(model))

        expected = {
            f"{name}.{param_name}": param
            for name, module in model.named_modules()
            if isinstance(module, LoraAdapter)
            for param_name, param in module.named_parameters()
        }

        state_dict = facade.state_dict()

        assert state_dict.keys() == expected.keys()

        assert all(torch.equal(state_dict[key], param) for key, param in expected.items())  # type: ignore[arg-type]

    def test_loading_sets_the_adapters_and_leaves_the_base(self) -> None:
        model, other = _lora_model(seed=1), _lora_model(seed=2)

        base_before = {key: tensor.clone() for key, tensor in model.state_dict().items() if ".lora." not in key}

        LoraCheckpointFacade(get_data_parallel_facade(model)).load_state_dict(LoraCheckpointFacade(get_data_parallel_facade(other)).state_dict())

        other_state = other.state_dict()

        for key, tensor in model.state_dict().items():
            expected = other_state[key] if ".lora." in key else base_before[key]

            assert torch.equal(tensor, expected), key

    def test_loading_a_whole_model_or_missing_adapters_is_an_error(self) -> None:
        model = _lora_model(seed=1)

        facade = LoraCheckpointFacade(get_data_parallel_facade(model))

        whole = dict(model.state_dict())

        with pytest.raises(StateDictError, match=r"must hold the LoRA adapters of the model and nothing else, but misses none and has decoder\.layer_norm\.weight, "):
            facade.load_state_dict(whole)

        adapters = facade.state_dict()

        missing_key = sorted(adapters)[0]

        del adapters[missing_key]

        with pytest.raises(StateDictError, match=rf"but misses {missing_key} and has none too\."):
            facade.load_state_dict(adapters)
