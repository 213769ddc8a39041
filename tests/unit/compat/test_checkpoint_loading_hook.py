"""The checkpoint-loading hook of the model families
(:mod:`qwen35_fs2.compat.checkpoint_loading_hook`): what it relies on in
fairseq2 0.8.1, on a real family of a tiny model and real checkpoint files.
What the Qwen3.5 families do with it is tested by
``tests/integration/sharding/test_recipe_sharded_loading.py`` (the families
defer the loading in a recipe) and ``tests/integration/models`` (they load as
fairseq2 does elsewhere)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.nn import Linear, Module

from fairseq2.assets import AssetCard, AssetCardError
from fairseq2.device import CPU
from fairseq2.gang import create_fake_gangs
from fairseq2.models.family import StandardModelFamily
from fairseq2.runtime.dependency import DependencyLookup, get_dependency_resolver, wire_object

from qwen35_fs2.compat.checkpoint_loading_hook import CheckpointLoadRequest, CheckpointLoadingHookFamily

_REMEDY = (
    "fairseq2's `StandardModelFamily` no longer loads checkpoint directories through `_do_load_model(path, config, gangs, "
    "dtype, load_rank0_only, mmap, restrict)`: revisit `qwen35_fs2.compat.checkpoint_loading_hook` (and with it the "
    "deferred loading of `Qwen35ModelFamily.load_checkpoint`)."
)


@dataclass(kw_only=True)
class _TinyConfig:
    dim: int = 3
    """The size of the tiny model's square projection."""


def _create_tiny_model(config: _TinyConfig) -> Linear:
    return Linear(config.dim, config.dim)


class _RecordingFamily(CheckpointLoadingHookFamily):
    """Records each checkpoint it is asked to load, then loads it as
    fairseq2 does."""

    requests: list[CheckpointLoadRequest]

    def load_checkpoint(self, request: CheckpointLoadRequest) -> Module:
        self.requests.append(request)

        return super().load_checkpoint(request)


def _family() -> _RecordingFamily:
    resolver = get_dependency_resolver()

    family = wire_object(
        resolver,
        _RecordingFamily,
        name="tiny_linear",
        kls=Linear,
        configs=DependencyLookup(resolver, _TinyConfig),
        factory=_create_tiny_model,
        supports_meta=True,
        restrict=True,
        # Plain checkpoints of an unsharded model, never compiled or wrapped.
        **dict.fromkeys(["state_dict_converter", "shard_specs", "compiler", "fsdp_applier", "layerwise_ac_applier"]),
    )

    family.requests = []

    return family


def _save_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Saves a single-file PyTorch checkpoint of a tiny model to ``path``;
    returns its state dict."""
    state_dict = {"weight": torch.arange(9.0).reshape(3, 3), "bias": torch.tensor([-1.0, 0.5, 2.0])}

    path.parent.mkdir(parents=True, exist_ok=True)

    torch.save(state_dict, path)

    return state_dict


def _assert_loaded(model: Module, state_dict: dict[str, torch.Tensor]) -> None:
    assert isinstance(model, Linear)

    loaded = model.state_dict()

    assert loaded.keys() == state_dict.keys()

    for key, tensor in state_dict.items():
        assert torch.equal(loaded[key], tensor), key


class TestFairseq2ModelFamily:
    def test_loads_checkpoints_through_do_load_model_with_this_signature(self) -> None:
        do_load_model = getattr(StandardModelFamily, "_do_load_model", None)

        assert do_load_model is not None, _REMEDY

        parameters = list(inspect.signature(do_load_model).parameters)

        assert parameters == ["self", "path", "config", "gangs", "dtype", "load_rank0_only", "mmap", "restrict"], _REMEDY

    def test_load_custom_model_hands_the_path_to_the_hook(self, tmp_path: Path) -> None:
        path = tmp_path / "model.pt"

        state_dict = _save_checkpoint(path)

        family = _family()

        config = _TinyConfig()

        gangs = create_fake_gangs(CPU)

        model = family.load_custom_model(path, config, gangs, torch.float32, load_rank0_only=False, mmap=True, restrict=None)

        assert family.requests == [CheckpointLoadRequest(path, config, gangs, torch.float32, False, True, None)], _REMEDY

        _assert_loaded(model, state_dict)

    def test_load_model_hands_the_checkpoint_of_the_card_to_the_hook(self, tmp_path: Path) -> None:
        # `checkpoint_path` is a file within the checkpoint's directory, and
        # the card's `restrict` wins over the family's: fairseq2 resolves
        # both before it loads.
        state_dict = _save_checkpoint(tmp_path / "download" / "sub" / "model.pt")

        card = AssetCard(
            "tiny_card",
            {"name": "tiny_card", "model_family": "tiny_linear", "checkpoint": f"file://{tmp_path / 'download'}", "checkpoint_path": "sub/model.pt", "restrict": False},
        )

        family = _family()

        gangs = create_fake_gangs(CPU)

        model = family.load_model(card, gangs, torch.float32, config=None, load_rank0_only=True, mmap=False)

        assert family.requests == [CheckpointLoadRequest(tmp_path / "download" / "sub" / "model.pt", _TinyConfig(), gangs, torch.float32, True, False, False)], _REMEDY

        _assert_loaded(model, state_dict)

    def test_load_model_maps_errors_of_the_hook_to_errors_of_the_card(self, tmp_path: Path) -> None:
        # `Qwen35ModelFamily.load_checkpoint` relies on it for its own and
        # fairseq2's checkpoint errors.
        card = AssetCard("tiny_card", {"name": "tiny_card", "model_family": "tiny_linear", "checkpoint": f"file://{tmp_path / 'missing.pt'}"})

        family = _family()

        with pytest.raises(AssetCardError, match=r"missing\.pt pointed to by the checkpoint field of the tiny_card asset card is not found"):
            family.load_model(card, create_fake_gangs(CPU), torch.float32, config=None, load_rank0_only=False, mmap=False)

        assert len(family.requests) == 1, _REMEDY
