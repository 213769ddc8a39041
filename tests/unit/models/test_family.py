"""The Qwen3.5 model family defers loading Hugging Face checkpoints to the
sharded loading of the recipe that enabled it, and loads everything else as
fairseq2 does. The families' wiring in a recipe and the loading into the
shards are tested by
``tests/integration/sharding/test_recipe_sharded_loading.py``."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor
from torch.nn import Module

from fairseq2.assets import AssetCard
from fairseq2.device import CPU, META_DEVICE
from fairseq2.gang import create_fake_gangs
from fairseq2.model_checkpoint import CorruptModelCheckpointError
from fairseq2.models import ModelFamily
from fairseq2.runtime.dependency import get_dependency_resolver

from qwen35_fs2.hf.export import build_hf_config
from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from qwen35_fs2.hf.sharded_loading import DeferredCheckpoint, ShardedCheckpointLoading
from qwen35_fs2.models.family import Qwen35ModelFamily
from qwen35_fs2.models.qwen35 import QWEN35_FAMILY, create_qwen35_model
from qwen35_fs2.models.qwen35.config import Qwen35Config, tiny_qwen35_config


def _family(sharded_loading: ShardedCheckpointLoading | None) -> Qwen35ModelFamily:
    """The dense family as the container of a recipe makes it, with
    ``sharded_loading`` as that recipe's."""
    family = get_dependency_resolver().resolve(ModelFamily, key=QWEN35_FAMILY)  # type: ignore[type-abstract]

    assert isinstance(family, Qwen35ModelFamily)

    family.sharded_loading = sharded_loading

    return family


def _random_model(config: Qwen35Config) -> Module:
    torch.manual_seed(0)

    model = create_qwen35_model(config)

    with torch.no_grad():
        for param in model.parameters():
            param.normal_()

    return model


def _load(family: Qwen35ModelFamily, path: Path, config: Qwen35Config) -> Module:
    return family.load_custom_model(path, config, create_fake_gangs(CPU), torch.float32, load_rank0_only=False, mmap=False, restrict=None)


def _assert_state_dict(model: Module, expected: dict[str, Tensor]) -> None:
    state_dict = model.state_dict()

    assert state_dict.keys() == expected.keys()

    for key, tensor in expected.items():
        assert torch.equal(state_dict[key], tensor), key


class TestQwen35ModelFamily:
    def test_defers_a_hf_checkpoint_to_the_sharded_loading_of_its_recipe(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        save_file(to_hg_state_dict(_random_model(config).state_dict(), config), tmp_path / "model.safetensors")

        loading, other_recipes_loading = ShardedCheckpointLoading(), ShardedCheckpointLoading()

        model = _load(_family(loading), tmp_path, config)

        assert all(param.device == META_DEVICE for param in model.parameters())

        assert other_recipes_loading.take(model) is None

        assert loading.take(model) == DeferredCheckpoint(tmp_path, config)

        # Taken once.
        assert loading.take(model) is None

    def test_loads_a_hf_checkpoint_without_sharded_loading(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        trained = _random_model(config).state_dict()

        save_file(to_hg_state_dict(trained, config), tmp_path / "model.safetensors")

        _assert_state_dict(_load(_family(None), tmp_path, config), trained)

    def test_loads_a_native_checkpoint_with_sharded_loading(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        trained = _random_model(config).state_dict()

        torch.save(trained, tmp_path / "model.pt")

        loading = ShardedCheckpointLoading()

        model = _load(_family(loading), tmp_path / "model.pt", config)

        _assert_state_dict(model, trained)

        assert loading.take(model) is None


def _save_hf_checkpoint(path: Path, config: Qwen35Config) -> dict[str, Tensor]:
    """Saves a random model of ``config`` with its config.json; returns its
    state."""
    trained = _random_model(config).state_dict()

    save_file(to_hg_state_dict(trained, config), path / "model.safetensors")

    hf_config = build_hf_config(config, base=None, text_only=True, dtype=torch.float32, num_mtp_layers=config.mtp_num_layers)

    (path / "config.json").write_text(json.dumps(hf_config))

    return trained


class TestModelPathConfig:
    """A checkpoint of ``model.path`` is configured by ``model.arch`` and the
    overrides, which must describe the model of its config.json."""

    @pytest.mark.parametrize("sharded", [False, True], ids=["rank0", "sharded"])
    def test_refuses_a_config_that_differs_in_fields_of_no_shape(self, tmp_path: Path, sharded: bool) -> None:
        checkpoint_config = tiny_qwen35_config()

        checkpoint_config.rope_theta = 1234.0
        checkpoint_config.rms_norm_eps = 1e-2

        _save_hf_checkpoint(tmp_path, checkpoint_config)

        family = _family(ShardedCheckpointLoading() if sharded else None)

        with pytest.raises(CorruptModelCheckpointError, match=r"must be the one of the config.json of .*, but differs in: `rope_theta` 10000000.0 -> 1234.0, `rms_norm_eps` 1e-06 -> 0.01 \(the model's value -> the checkpoint's\)"):
            _load(family, tmp_path, tiny_qwen35_config())

    @pytest.mark.parametrize("sharded", [False, True], ids=["rank0", "sharded"])
    def test_refuses_a_file_of_the_checkpoint_directory(self, tmp_path: Path, sharded: bool) -> None:
        # fairseq2 loads a safetensors file as it is: its directory's
        # config.json, here of another rope_theta, would go unchecked.
        checkpoint_config = tiny_qwen35_config()

        checkpoint_config.rope_theta = 1234.0

        _save_hf_checkpoint(tmp_path, checkpoint_config)

        family = _family(ShardedCheckpointLoading() if sharded else None)

        with pytest.raises(CorruptModelCheckpointError, match=rf"must be named by its directory \({tmp_path}\), whose config.json describes it, but {tmp_path}/model.safetensors is one of its files"):
            _load(family, tmp_path / "model.safetensors", tiny_qwen35_config())

    def test_an_asset_card_may_name_a_file_of_the_checkpoint_directory(self, tmp_path: Path) -> None:
        # Its configuration comes from the file's directory.
        config = tiny_qwen35_config()

        trained = _save_hf_checkpoint(tmp_path, config)

        family = _family(None)

        card = AssetCard("tiny_file", {"name": "tiny_file", "model_family": "qwen35", "model_arch": "qwen35_tiny", "checkpoint": f"file://{tmp_path}/model.safetensors"})

        model = family.load_model(card, create_fake_gangs(CPU), torch.float32, family.get_model_config(card), load_rank0_only=False, mmap=False)

        _assert_state_dict(model, trained)

    def test_loads_with_the_checkpoints_config_and_run_settings_of_its_own(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        trained = _save_hf_checkpoint(tmp_path, config)

        run_config = copy.deepcopy(config)

        # Pretraining pads with nothing, a run may train shorter sequences.
        run_config.pad_idx = None
        run_config.max_seq_len = 512

        _assert_state_dict(_load(_family(None), tmp_path, run_config), trained)

    def test_says_when_the_checkpoints_mtp_head_is_left_out(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        config = tiny_qwen35_config()

        config.mtp_num_layers = 1

        _save_hf_checkpoint(tmp_path, config)

        without_head = copy.deepcopy(config)

        without_head.mtp_num_layers = 0

        with caplog.at_level(logging.WARNING):
            model = _load(_family(None), tmp_path, without_head)

        assert f"{tmp_path} has an MTP head, which the model is loaded without" in caplog.text

        assert not any(key.startswith("mtp.") for key in model.state_dict())
