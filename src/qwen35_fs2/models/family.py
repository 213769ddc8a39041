"""Puts sharded checkpoint loading into fairseq2's recipes.

fairseq2 0.8.1 recipes load a model through its family on data-parallel
rank 0 and broadcast it while wrapping it with FSDP. A recipe that calls
:func:`enable_sharded_checkpoint_loading` in ``Recipe.register`` and
:func:`finish_sharded_checkpoint_loading` in ``Recipe.setup_model`` loads
Hugging Face checkpoints into each rank's shards instead:

1. the Qwen3.5 families (:class:`Qwen35ModelFamily`) return the model on the
   meta device, on every rank, and remember the checkpoint;
2. ``setup_model`` applies layerwise activation checkpointing and FSDP2 as
   the trainer section asks, allocates the rank's shards and reads them
   (:mod:`qwen35_fs2.hf.sharded_loading`);
3. fairseq2 then finds the model sharded: the families' activation
   checkpointing and FSDP appliers leave it as it is.

Native fairseq2 checkpoints, resumed runs (fairseq2 then creates the model on
the meta device and loads its own sharded checkpoint) and recipes that do not
enable it load as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, final
from weakref import WeakKeyDictionary

from torch.nn import Module
from typing_extensions import override

from fairseq2.assets import AssetCard, AssetCardError
from fairseq2.data_type import DataType
from fairseq2.error import InternalError
from fairseq2.gang import Gangs
from fairseq2.logging import log
from fairseq2.models import ModelFamily
from fairseq2.models.family import (
    LayerwiseACApplier,
    ModelCompiler,
    ModelFactory,
    ModelFSDPApplier,
    ModelStateDictConverter,
    StandardModelFamily,
)
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.recipe.base import RecipeContext
from fairseq2.recipe.config import TrainerSection
from fairseq2.runtime.dependency import (
    DependencyContainer,
    DependencyLookup,
    DependencyResolver,
    wire_object,
)
from fairseq2.utils.validation import ValidationError

from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.hf.config import adopt_hf_architecture, drop_absent_mtp_head, qwen35_config_from_hf
from qwen35_fs2.hf.config import find_checkpoint_hf_config, load_hf_config
from qwen35_fs2.models.qwen35.interop import is_hg_state_dict
from qwen35_fs2.hf.sharded_loading import allocate_shards, load_hf_checkpoint_shards
from qwen35_fs2.hf.safetensors import index_safetensors
from qwen35_fs2.parallel.ac import apply_ac_to_qwen35


@final
class ShardedCheckpointLoading:
    """Registered in a recipe's container by
    :func:`enable_sharded_checkpoint_loading`."""


def enable_sharded_checkpoint_loading(container: DependencyContainer) -> None:
    """Makes the Qwen3.5 families defer loading Hugging Face checkpoints to
    :func:`finish_sharded_checkpoint_loading`; call it in
    ``Recipe.register``."""
    container.register_instance(ShardedCheckpointLoading, ShardedCheckpointLoading())


@final
@dataclass(frozen=True)
class _PendingCheckpoint:
    path: Path
    config: Qwen35Config


# The models whose checkpoint is still to be read, by model.
_PENDING: WeakKeyDictionary[Module, _PendingCheckpoint] = WeakKeyDictionary()


class Qwen35ModelFamily(StandardModelFamily):  # type: ignore[misc]
    """fairseq2's model family, except that

    - the configuration of an asset card takes its architecture from the
      checkpoint's own Hugging Face ``config.json`` where there is one
      (:meth:`get_model_config`);
    - where sharded loading is enabled it returns models of Hugging Face
      checkpoints on the meta device and leaves the loading to
      :func:`finish_sharded_checkpoint_loading`.
    """

    defer_hf_loading: bool = False
    """Set by :func:`register_qwen35_model_family` where the recipe enabled
    sharded loading."""

    @override
    def get_model_config(self, card: AssetCard) -> object:
        """Returns the configuration of ``card`` (its arch preset and config
        overrides, as fairseq2 makes it) with every field that a Hugging Face
        config defines taken from the ``config.json`` of its checkpoint, if
        there is one (:func:`~qwen35_fs2.hf.config.find_checkpoint_hf_config`).

        The presets of some released sizes hold values inferred from
        secondary sources (the tie flags of 0.8B to 4B among them), and a
        wrong tie flag would drop a trained output projection, so the
        checkpoint's own description wins; a warning lists every field in
        which the two differ. Recipes apply their ``config_overrides`` on top.
        """
        config = super().get_model_config(card)

        config_file = find_checkpoint_hf_config(card)

        if config_file is None:
            return config

        if not isinstance(config, Qwen35Config):
            raise InternalError(f"The configuration of the {self.name} family is of type `{type(config)}`.")

        try:
            checkpoint_config = qwen35_config_from_hf(load_hf_config(config_file.parent))
        except (ValueError, ValidationError) as ex:
            raise AssetCardError(
                card.name, f"{config_file}, the config.json of the checkpoint of the {card.name} asset card, must describe a Qwen3.5 model, but does not: {ex}"
            ) from ex

        if type(checkpoint_config) is not type(config):
            raise AssetCardError(
                card.name, f"{config_file}, the config.json of the checkpoint of the {card.name} asset card, must describe a model of the {self.name} family, but describes a `{type(checkpoint_config).__name__}` instead."
            )

        checkpoint_dir = config_file.parent

        # The safetensors next to the config.json: a local checkpoint, or the
        # Hub cache once fairseq2 downloaded them.
        if any(checkpoint_dir.glob("*.safetensors")):
            checkpoint_config = drop_absent_mtp_head(
                checkpoint_config, index_safetensors(checkpoint_dir).keys(), checkpoint_dir
            )

        config, changes = adopt_hf_architecture(config, checkpoint_config)

        if changes:
            log.warning(
                "The configuration of the {} asset card differs from the checkpoint's own config.json ({}); the checkpoint's values are used: {}",
                card.name,
                config_file,
                ", ".join(changes),
            )

        return config

    @override
    def _do_load_model(
        self,
        path: Path,
        config: object,
        gangs: Gangs,
        dtype: DataType,
        load_rank0_only: bool,
        mmap: bool,
        restrict: bool | None,
    ) -> Module:
        if not self.defer_hf_loading or not isinstance(config, Qwen35Config) or not _is_hf_checkpoint(path):
            model: Module = super()._do_load_model(path, config, gangs, dtype, load_rank0_only, mmap, restrict)

            return model

        log.info("Deferring the loading of {} until the model is sharded; each rank will read its own shards.", path)

        model = self._do_create_model(config, gangs, dtype, meta=True)

        _PENDING[model] = _PendingCheckpoint(path, config)

        return model


def _is_hf_checkpoint(path: Path) -> bool:
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        return False

    return is_hg_state_dict(index_safetensors(path))


ConfigT = TypeVar("ConfigT", bound=Qwen35Config)


def register_qwen35_model_family(
    container: DependencyContainer,
    name: str,
    *,
    config_kls: type[ConfigT],
    factory: ModelFactory[ConfigT, TransformerLM],
    state_dict_converter: ModelStateDictConverter[ConfigT],
    compiler: ModelCompiler[TransformerLM],
    fsdp_applier: ModelFSDPApplier[TransformerLM],
    layerwise_ac_applier: LayerwiseACApplier[TransformerLM],
) -> None:
    """Registers a :class:`Qwen35ModelFamily` of :class:`TransformerLM` models
    as fairseq2's ``register_model_family`` registers its family."""

    def create_family(resolver: DependencyResolver) -> ModelFamily:
        family = wire_object(
            resolver,
            Qwen35ModelFamily,
            name=name,
            kls=TransformerLM,
            configs=DependencyLookup(resolver, config_kls),
            factory=factory,
            supports_meta=True,
            restrict=True,
            state_dict_converter=state_dict_converter,
            shard_specs=None,
            compiler=compiler,
            fsdp_applier=fsdp_applier,
            layerwise_ac_applier=layerwise_ac_applier,
        )

        family.defer_hf_loading = resolver.maybe_resolve(ShardedCheckpointLoading) is not None

        return family

    container.register(ModelFamily, create_family, key=name)  # type: ignore[type-abstract]


def finish_sharded_checkpoint_loading(context: RecipeContext, model: Module) -> Module:
    """Shards ``model`` and reads its checkpoint into the shards if its family
    deferred the loading; returns ``model``, otherwise untouched. Call it in
    ``Recipe.setup_model`` before anything else uses the model.

    With FSDP (``trainer.data_parallelism: fsdp`` over more than one rank)
    the model is sharded as the trainer section asks (``fsdp.granularity``
    ``layer`` or ``stack``, ``reshard_after_forward``, ``fp32_reduce``, static
    mixed precision) after layerwise activation checkpointing, if any; with
    DDP or a single data-parallel rank, every rank reads its tensor-parallel
    shard in full.
    """
    pending = _PENDING.pop(model, None)

    if pending is None:
        return model

    if not isinstance(model, TransformerLM):
        raise TypeError(f"`model` must be a `TransformerLM`, but is a `{type(model).__name__}` instead.")

    gangs = context.gangs

    trainer = context.resolver.resolve(TrainerSection)

    if _uses_fsdp(trainer, gangs):
        fsdp = trainer.fsdp

        if fsdp.version != "v2":
            raise ValueError(
                f"`trainer.fsdp.version` must be 'v2' to load a checkpoint into FSDP shards, but is '{fsdp.version}' instead."
            )

        # fairseq2 wraps the whole model itself at this granularity, broadcasting
        # from rank 0.
        if fsdp.granularity not in ("layer", "stack"):
            raise ValueError(
                f"`trainer.fsdp.granularity` must be 'layer' or 'stack' to load a checkpoint into FSDP shards, but is '{fsdp.granularity}' instead."
            )

        ac = trainer.activation_checkpointing

        # Activation checkpointing goes inside the FSDP units, as fairseq2
        # applies it.
        if ac.mode == "layerwise":
            apply_ac_to_qwen35(model, ac.every_nth_layer)

        mixed_precision = trainer.mixed_precision

        allocate_shards(
            model,
            gangs,
            fsdp_granularity=fsdp.granularity,
            mixed_precision_dtype=mixed_precision.dtype if mixed_precision.mode == "static" else None,
            fp32_reduce=fsdp.fp32_reduce,
            reshard_after_forward=fsdp.reshard_after_forward,
        )
    else:
        allocate_shards(model, gangs, fsdp_granularity=None)

    load_hf_checkpoint_shards(model, pending.path, pending.config, gangs)

    log.info("Every rank read its shards of {}.", pending.path)

    return model


def _uses_fsdp(trainer: TrainerSection, gangs: Gangs) -> bool:
    """Whether fairseq2's data-parallel wrapper would use FSDP."""
    if gangs.dp.size == 1 or trainer.data_parallelism != "fsdp":
        return False

    # fairseq2 falls back to DDP.
    return not (gangs.rdp.size > 1 and gangs.sdp.size == 1)
