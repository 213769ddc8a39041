"""The fairseq2 model family that both Qwen3.5 families register
(:func:`register_qwen35_model_family`): fairseq2's, except that an asset
card's architecture comes from its checkpoint's own ``config.json``, and that
in a recipe that enabled sharded loading the Hugging Face checkpoints are
read into each rank's shards (:mod:`qwen35_fs2.hf.sharded_loading`) instead
of on rank 0.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Final, TypeVar

from torch.nn import Module
from typing_extensions import override

from fairseq2.assets import AssetCard, AssetCardError
from fairseq2.data_type import DataType
from fairseq2.error import InternalError
from fairseq2.gang import Gangs
from fairseq2.logging import log
from fairseq2.model_checkpoint import CorruptModelCheckpointError
from fairseq2.models import ModelFamily
from fairseq2.models.family import (
    LayerwiseACApplier,
    ModelCompiler,
    ModelFactory,
    ModelFSDPApplier,
    ModelStateDictConverter,
)
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.runtime.dependency import (
    DependencyContainer,
    DependencyLookup,
    DependencyResolver,
    wire_object,
)
from fairseq2.utils.validation import ValidationError

from qwen35_fs2.compat.checkpoint_loading_hook import CheckpointLoadRequest, CheckpointLoadingHookFamily
from qwen35_fs2.hf.config import (
    adopt_hf_architecture,
    drop_absent_mtp_head,
    find_checkpoint_hf_config,
    find_checkpoint_tensor_names,
    load_hf_config,
    qwen35_config_from_hf,
)
from qwen35_fs2.hf.safetensors import SafetensorsTensor, index_safetensors
from qwen35_fs2.hf.sharded_loading import DeferredCheckpoint, MetaModelOrigin, ShardedCheckpointLoading
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.models.qwen35.interop import has_mtp_tensors, is_hg_state_dict


class Qwen35ModelFamily(CheckpointLoadingHookFamily):
    """fairseq2's model family, except that

    - the configuration of an asset card takes its architecture from the
      checkpoint's own Hugging Face ``config.json`` where there is one
      (:meth:`get_model_config`);
    - where the recipe enabled sharded loading it returns models of Hugging
      Face checkpoints on the meta device and leaves the loading to
      :func:`~qwen35_fs2.hf.sharded_loading.finish_sharded_checkpoint_loading`
      (:meth:`load_checkpoint`).
    """

    sharded_loading: ShardedCheckpointLoading | None = None
    """The sharded loading of the recipe whose container created the family
    (set by :func:`register_qwen35_model_family`), ``None`` where the recipe
    did not enable it."""

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

        tensor_names = find_checkpoint_tensor_names(card, checkpoint_dir)

        if tensor_names is not None:
            checkpoint_config = drop_absent_mtp_head(checkpoint_config, tensor_names, checkpoint_dir)

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
    def create_new_model(
        self, config: object, gangs: Gangs, dtype: DataType, meta: bool, init_rank0_only: bool
    ) -> Module:
        """Creates the model as fairseq2 does and, on the meta device in a
        recipe with sharded loading, records its family and configuration
        there (:meth:`ShardedCheckpointLoading.record_origin`): fairseq2
        creates the model of a resumed run so, and a resumed LoRA run reads
        its base into a model like it."""
        model: Module = super().create_new_model(config, gangs, dtype, meta, init_rank0_only)

        if meta and self.sharded_loading is not None and isinstance(config, Qwen35Config):
            self.sharded_loading.record_origin(model, MetaModelOrigin(self, config))

        return model

    @override
    def load_custom_model(
        self,
        path: Path,
        config: object,
        gangs: Gangs,
        dtype: DataType,
        load_rank0_only: bool,
        mmap: bool,
        restrict: bool | None,
    ) -> Module:
        """Loads the checkpoint at ``path`` (a recipe's ``model.path``) as
        fairseq2 does, after checking that ``config`` describes the model of
        its ``config.json``, if it is a Hugging Face checkpoint
        (:func:`check_hf_checkpoint_config`)."""
        if isinstance(config, Qwen35Config):
            _check_not_a_file_of_hf_checkpoint(path)

            index = _hf_checkpoint_index(path)

            if index is not None:
                check_hf_checkpoint_config(path, config, index.keys())

        model: Module = super().load_custom_model(path, config, gangs, dtype, load_rank0_only, mmap, restrict)

        return model

    @override
    def load_checkpoint(self, request: CheckpointLoadRequest) -> Module:
        sharded_loading = self.sharded_loading

        path, config = request.path, request.config

        if sharded_loading is None or not isinstance(config, Qwen35Config) or _hf_checkpoint_index(path) is None:
            return super().load_checkpoint(request)

        log.info("Deferring the loading of {} until the model is sharded; each rank will read its own shards.", path)

        model = self.create_new_model(config, request.gangs, request.dtype, meta=True, init_rank0_only=False)

        sharded_loading.defer(model, DeferredCheckpoint(path, config))

        return model


# The fields of a configuration that a run may set apart from the
# checkpoint's config.json: the token that is padding, the longest sequence
# the run expects, the scale of the initialization (which a loaded model
# does not use), and whether the MTP head is trained (its tensors are left
# out without one; said in the log below).
_RUN_SETTINGS: Final = ("pad_idx", "max_seq_len", "init_std", "mtp_num_layers")


def check_hf_checkpoint_config(path: Path, config: Qwen35Config, keys: Collection[str]) -> None:
    """Checks that ``config`` describes the model of the Hugging Face
    checkpoint directory ``path`` with tensors ``keys``, as its
    ``config.json`` does.

    A checkpoint named by ``model.path`` is loaded with the configuration of
    ``model.arch`` (or the family's default) and ``model.config_overrides``,
    not with its ``config.json``, which fairseq2 0.8.1 does not read there.
    A field that changes no tensor's shape (``rope_theta``,
    ``partial_rotary_factor``, ``rms_norm_eps``, ``normalize_top_k``, ...)
    would load the weights into a model computing something else without a
    word; an asset card (``model.name``) takes them from the checkpoint.

    A checkpoint without ``config.json`` has nothing to check against.

    :raises CorruptModelCheckpointError: if a field differs.
    """
    if not path.joinpath("config.json").is_file():
        return

    try:
        checkpoint_config = qwen35_config_from_hf(load_hf_config(path))
    except (ValueError, ValidationError) as ex:
        raise CorruptModelCheckpointError(path, f"The config.json of {path} must describe a Qwen3.5 model, but does not: {ex}") from ex

    if type(checkpoint_config) is not type(config):
        raise CorruptModelCheckpointError(
            path, f"The config.json of {path} must describe a `{type(config).__name__}` model, but describes a `{type(checkpoint_config).__name__}` instead."
        )

    if config.mtp_num_layers == 0 and has_mtp_tensors(keys):
        log.warning("{} has an MTP head, which the model is loaded without (`mtp_num_layers` is 0); set `model.config_overrides: {{mtp_num_layers: 1}}` to load and train it.", path)  # fmt: skip

    _, changes = adopt_hf_architecture(config, checkpoint_config)

    changes = [change for change in changes if change.split("`")[1] not in _RUN_SETTINGS]

    if changes:
        raise CorruptModelCheckpointError(
            path,
            f"The model configuration must be the one of the config.json of {path}, but differs in: {', '.join(changes)} (the model's value -> the checkpoint's). "
            "fairseq2 configures a model of `model.path` by `model.arch` and `model.config_overrides` alone: set them to the checkpoint's values, or name the checkpoint by an asset card (`model.name`), whose configuration comes from its config.json.",
        )


def _check_not_a_file_of_hf_checkpoint(path: Path) -> None:
    """Raises :class:`CorruptModelCheckpointError` if ``path``, a recipe's
    ``model.path``, is a safetensors file of a Hugging Face checkpoint
    directory (one with a ``config.json``): fairseq2 loads such a file as it
    is, so its directory's ``config.json`` would go unchecked
    (:func:`check_hf_checkpoint_config`) and a sharded checkpoint would be
    read in part. An asset card may name a file: its configuration comes
    from the file's directory (:func:`~qwen35_fs2.hf.config.find_checkpoint_hf_config`)."""
    if path.is_file() and path.suffix == ".safetensors" and path.parent.joinpath("config.json").is_file():
        raise CorruptModelCheckpointError(
            path, f"A Hugging Face checkpoint must be named by its directory ({path.parent}), whose config.json describes it, but {path} is one of its files."
        )


def _hf_checkpoint_index(path: Path) -> dict[str, SafetensorsTensor] | None:
    """Returns the tensors of ``path`` by name if it is a Hugging Face
    checkpoint directory, ``None`` otherwise."""
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        return None

    index = index_safetensors(path)

    return index if is_hg_state_dict(index) else None


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

        family.sharded_loading = resolver.maybe_resolve(ShardedCheckpointLoading)

        return family

    container.register(ModelFamily, create_family, key=name)  # type: ignore[type-abstract]
