"""Exporting the checkpoints of training runs, Hugging Face directories and
asset cards: finding the checkpoint, its configuration and the base it was
trained from, then exporting it (what ``fairseq2 lm export_hf`` runs).

The checkpoint of a LoRA run (a run whose configuration has a ``lora``
section) holds the adapters alone, and the run's checkpoint directory
records the Hugging Face checkpoint of the base they adapt
(:mod:`qwen35_fs2.lora.checkpoint`); it is exported either as a PEFT adapter
directory (``adapter=True``) or as a whole model with the adapters merged
into the recorded base (``merge=True``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

import torch
import yaml

from fairseq2.assets import AssetCard, AssetStore
from fairseq2.assets.download_manager import get_asset_download_manager
from fairseq2.data_type import DataType
from fairseq2.device import CPU
from fairseq2.error import StateDictError
from fairseq2.gang import create_fake_gangs
from fairseq2.logging import log
from fairseq2.model_checkpoint import CorruptModelCheckpointError
from fairseq2.models import ModelFamily, ModelHub
from fairseq2.nn.data_parallel import get_data_parallel_facade
from fairseq2.nn.utils.module import reset_non_persistent_buffers, to_empty
from fairseq2.runtime.dependency import get_dependency_resolver

from qwen35_fs2.hf.config import drop_absent_mtp_head, load_hf_config, qwen35_config_from_hf
from qwen35_fs2.hf.export.plan import check_architecture, holds_tokenizer, plan_hf_export
from qwen35_fs2.hf.export.repository import HfExportError, HfRepository
from qwen35_fs2.hf.export.writer import DEFAULT_MAX_SHARD_SIZE, check_output_dir, write_hf_export
from qwen35_fs2.hf.safetensors import index_safetensors
from qwen35_fs2.hf.sharded_loading import load_hf_checkpoint_shards
from qwen35_fs2.lora import apply_lora, check_peft_base, merge_lora_state_dict, save_peft_adapter
from qwen35_fs2.lora.checkpoint import (
    LORA_BASE_FILE,
    LoraBase,
    LoraBaseError,
    LoraCheckpointFacade,
    check_lora_base,
    load_lora_base,
)
from qwen35_fs2.lora.sharded import read_lora_checkpoint
from qwen35_fs2.models.qwen35.config import QWEN35_FAMILY, Qwen35Config
from qwen35_fs2.models.qwen35.tokenizer import QWEN35_TOKENIZER_ASSET, get_qwen35_tokenizer_dir
from qwen35_fs2.models.qwen35_moe.config import QWEN35_MOE_FAMILY, Qwen35MoeConfig

EXPORTABLE_FAMILIES: Final = (QWEN35_FAMILY, QWEN35_MOE_FAMILY)
"""The model families whose checkpoints this package exports."""

_STEP_DIR: Final = re.compile(r"step_([0-9]+)")

# The cards fairseq2 makes of the steps of a checkpoint directory.
_FAIRSEQ2_CHECKPOINT_CARD: Final = re.compile(
    r"checkpoint_step_[0-9]+|last_checkpoint|best_checkpoint(_[0-9]+)?"
)


class CheckpointError(Exception):
    """Raised when ``CHECKPOINT`` or ``--base`` cannot be found or read."""


@final
@dataclass(frozen=True)
class _Source:
    """A checkpoint to export and the base it was trained from."""

    description: str

    family: ModelFamily

    config: Qwen35Config

    path: Path
    """The checkpoint: a fairseq2 ``model`` directory or a Hugging Face one."""

    default_base: Path | None

    default_tokenizer: Path | None = None
    """The tokenizer directory the run trained with, for exports without a
    base."""

    lora_base: LoraBase | None = None
    """The base that the adapters of the checkpoint of a LoRA run adapt, and
    their configuration, as the run recorded them."""

    unrecorded_run: Path | None = None
    """The directory above the checkpoints of a training run whose
    ``config.yaml``, which records the run's base and tokenizer, is not
    there (checkpoints written elsewhere with ``--checkpoint-dir``)."""


def export_checkpoint(
    checkpoint: str,
    out_dir: Path,
    *,
    step: int | None = None,
    run_dir: Path | None = None,
    base: str | None = None,
    no_base: bool = False,
    tokenizer: str | None = None,
    dtype: DataType | None = None,
    text_only: bool = False,
    keep_base_mtp: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    adapter: bool = False,
    merge: bool = False,
) -> None:
    """Exports ``checkpoint`` as a Hugging Face repository at ``out_dir``:
    what ``fairseq2 lm export_hf`` does (see :mod:`qwen35_fs2.cli.export_hf`
    for the meaning of each argument).

    The checkpoint of a LoRA run must be exported with ``adapter`` (its
    adapters as a PEFT adapter directory for the base, in their dtype or
    ``dtype``) or ``merge`` (the model with the adapters merged in float32,
    then cast to the export dtype, as any other model).

    :raises CheckpointError: ``checkpoint``, ``base`` or ``tokenizer`` cannot
        be found or read.
    :raises HfExportError: the export cannot be made; nothing is written.
    """
    source = _resolve_source(checkpoint, step, run_dir)

    if source.unrecorded_run is not None and base is None and not no_base and source.lora_base is None:
        raise CheckpointError(
            f"The checkpoints of {source.description} must have the config.yaml of their run in {source.unrecorded_run}, which records the model the run started from and its tokenizer, but have none there (checkpoints written elsewhere with `--checkpoint-dir`). "
            "Give the run's output directory with `--run-dir`, the model the run started from with `--base`, or `--no-base` for a run from scratch."
        )

    _check_lora_export(source, adapter=adapter, merge=merge)

    if no_base:
        base_path = None
    elif base is not None:
        base_path = _resolve_base(base)
    else:
        base_path = source.default_base

    base_repo = None if base_path is None else HfRepository.open(base_path)

    if base_repo is not None and holds_tokenizer(base_repo.path):
        if tokenizer is not None:
            raise CheckpointError(
                f"`--tokenizer` is for exports without a base model, or with a base that holds no tokenizer, but {base_repo.path} holds one, which is carried over."
            )

        tokenizer_dir = None
    elif tokenizer is not None:
        tokenizer_dir = _resolve_tokenizer_dir(tokenizer)
    else:
        # The run's, also for a base that fairseq2 downloaded (its weights
        # and config alone).
        tokenizer_dir = source.default_tokenizer

    check_output_dir(out_dir, base=base_repo, force=force)

    if adapter:
        if text_only or tokenizer is not None:
            raise CheckpointError(
                "`--text-only` and `--tokenizer` are for model exports, so they must not be given with `--adapter`, but are."
            )

        _export_adapter(source, out_dir, base_repo, dtype, force)

        return

    if base_repo is None:
        log.info("Exporting {} without a base model: text-only, with the language model alone.", source.description)  # fmt: skip
    else:
        log.info("Exporting {} with {} as base model.", source.description, base_repo.path)

    if merge:
        # Every export dtype holds the float32 merge rounded once.
        model = _load_lora_model(source, torch.float32, read_base=True)

        state_dict = merge_lora_state_dict(model)

        if dtype is None and base_repo is None:
            dtype = _checkpoint_dtype(source)
    else:
        model = _load_model(source, _load_dtype(source, base_repo, dtype))

        state_dict = model.state_dict()

    plan = plan_hf_export(
        state_dict,
        source.config,
        base=base_repo,
        dtype=dtype,
        text_only=text_only,
        tokenizer_dir=tokenizer_dir,
        keep_base_mtp=keep_base_mtp,
    )

    write_hf_export(plan, out_dir, force=force, max_shard_size=max_shard_size)

    log.info("Hugging Face model written to {}.", out_dir)


def _check_lora_export(source: _Source, *, adapter: bool, merge: bool) -> None:
    if adapter and merge:
        raise CheckpointError("`--adapter` and `--merge` must not be given together, but are.")

    if source.lora_base is None:
        if adapter or merge:
            flag = "--adapter" if adapter else "--merge"

            raise CheckpointError(
                f"CHECKPOINT must be of a LoRA run (with a `lora` section in its config.yaml) to be exported with `{flag}`, but {source.description} has no LoRA adapters. Export it without `{flag}`."
            )

        return

    if not (adapter or merge):
        raise CheckpointError(
            f"{source.description} is the checkpoint of a LoRA run, so it must be exported with `--adapter` (a PEFT adapter directory for its base) or `--merge` (the model with the adapters merged), but neither is given."
        )


def _export_adapter(source: _Source, out_dir: Path, base: HfRepository | None, dtype: DataType | None, force: bool) -> None:
    """Writes the adapters of the LoRA checkpoint ``source`` as a PEFT
    adapter directory for ``base``, which must have the checkpoint's
    architecture."""
    assert source.lora_base is not None

    # The base the adapter is for, and the base the run adapted (as long as
    # it is where the run found it).
    bases: dict[Path, Mapping[str, object]] = {} if base is None else {base.path.resolve(): base.config}

    run_base = source.lora_base.path

    if run_base not in bases and run_base.joinpath("config.json").is_file():
        bases[run_base] = load_hf_config(run_base)

    for path, hf_config in bases.items():
        try:
            check_peft_base(hf_config, str(path))
        except ValueError as ex:
            raise HfExportError(f"{ex} Export the model with the adapters merged (`--merge`) instead.") from None

    if base is None:
        log.info("Exporting the LoRA adapters of {} without a base model: the adapter names none.", source.description)  # fmt: skip
    else:
        # An adapter of another architecture fails to load, or worse, loads
        # onto the projections of the same names and shapes.
        check_architecture(base, source.config)

        log.info("Exporting the LoRA adapters of {} for {}.", source.description, base.path)

        if base.is_vlm:
            log.warning("{} is a vision-language repository, which vLLM serves as `{}`: vLLM loads this adapter onto it without applying it (vllm-project/vllm#48019), and transformers loads it onto `AutoModelForCausalLM`. To serve the run with vLLM, export it with `--merge` (docs/export.md, \"Serving with vLLM\").", base.path, base.config.get("architectures", ["?"])[0])  # type: ignore[index]  # fmt: skip

    model = _load_lora_model(source, dtype or _checkpoint_dtype(source), read_base=False)

    save_peft_adapter(
        model,
        out_dir,
        config=source.lora_base.lora,
        model_config=source.config,
        base_model_name_or_path=None if base is None else str(base.path),
        force=force,
    )

    log.info("PEFT adapter written to {}.", out_dir)


def _load_model(source: _Source, dtype: DataType) -> torch.nn.Module:
    hub = _model_hub(source)

    try:
        return hub.load_custom_model(source.path, source.config, device=CPU, dtype=dtype)
    except CorruptModelCheckpointError as ex:
        # fairseq2 keeps the details (which keys, which shapes) in the cause.
        cause = "" if ex.__cause__ is None else f" {ex.__cause__}"

        raise CheckpointError(f"{ex}{cause}") from ex


def _load_lora_model(source: _Source, dtype: DataType, *, read_base: bool) -> torch.nn.Module:
    """Loads the checkpoint of a LoRA run: the model with the adapters of
    ``source.lora_base``, which fairseq2's loader does not know to create, put on
    it as the recipe puts them on before training, read from the checkpoint,
    and its base, if ``read_base``, read from the Hugging Face checkpoint
    that the run recorded. Without ``read_base`` the base is left
    uninitialized: a PEFT adapter is the adapters alone."""
    assert source.lora_base is not None

    hub = _model_hub(source)

    model = hub.create_new_model(source.config, device=CPU, dtype=dtype, meta=True)

    apply_lora(model, source.lora_base.lora, source.config)

    to_empty(model, CPU)

    if read_base:
        base = source.lora_base

        try:
            check_lora_base(base, base.path)

            load_hf_checkpoint_shards(model, base.path, source.config, create_fake_gangs(CPU))
        except (LoraBaseError, CorruptModelCheckpointError) as ex:
            raise CheckpointError(f"The base of {source.description} cannot be read: {ex}") from ex

    adapters = read_lora_checkpoint(source.path, model, create_fake_gangs(CPU), mmap=True)

    try:
        LoraCheckpointFacade(get_data_parallel_facade(model)).load_state_dict(adapters)
    except StateDictError as ex:
        raise CheckpointError(
            f"The checkpoint of {source.description} must hold the adapters of its run's `lora` section, but does not: {ex}"
        ) from ex

    reset_non_persistent_buffers(model)

    return model


def _load_dtype(source: _Source, base: HfRepository | None, dtype: DataType | None) -> DataType:
    """Returns the dtype to load the checkpoint in: the export's, when all of
    its language-model tensors share one, else float32, which holds every
    export dtype exactly."""
    if dtype is not None:
        return dtype

    if base is not None:
        dtypes = {
            entry.dtype
            for key, entry in base.tensors.items()
            if not key.startswith(("model.visual.", "mtp.")) and entry.dtype.is_floating_point
        }

        return dtypes.pop() if len(dtypes) == 1 else torch.float32

    return _checkpoint_dtype(source)


def _checkpoint_dtype(source: _Source) -> DataType:
    """Returns the dtype of the first floating-point tensor of the
    checkpoint of ``source``."""
    hub = _model_hub(source)

    for _, tensor in hub.iter_checkpoint(source.path, source.config, mmap=True):
        if tensor.dtype.is_floating_point:
            return tensor.dtype

    return torch.float32


def _resolve_source(checkpoint: str, step: int | None, run_dir: Path | None) -> _Source:
    path = Path(checkpoint)

    if path.is_dir():
        if (path / "checkpoints" / "model.yaml").is_file():
            return _training_source(path / "checkpoints", step, run_dir)

        # The recipes put a run into a sweep directory (`ws_1.<hash>`) of the
        # output directory they are given.
        sweep_dirs = sorted(p.parent.parent for p in path.glob("*/checkpoints/model.yaml"))

        if len(sweep_dirs) > 1:
            raise CheckpointError(
                f"CHECKPOINT must hold one training run, but {path} holds several: {', '.join(d.name for d in sweep_dirs)}. Pass one of them."
            )

        if sweep_dirs:
            return _training_source(sweep_dirs[0] / "checkpoints", step, run_dir)

        if (path / "model.yaml").is_file():
            return _training_source(path, step, run_dir)

        match = _STEP_DIR.fullmatch(path.name)

        if match is not None and (path.parent / "model.yaml").is_file():
            if step is not None and step != int(match[1]):
                raise CheckpointError(
                    f"`--step` must be the step of {path} ({match[1]}) or be omitted, but is {step} instead."
                )

            return _training_source(path.parent, int(match[1]), run_dir)

        if (path / "config.json").is_file():
            _check_training_only(step, run_dir, path)

            return _hf_source(path)

        raise CheckpointError(
            f"CHECKPOINT must be a fairseq2 training output directory, its checkpoints or step_N directory, or a Hugging Face model directory, but {path} is none of these (it has no checkpoints/model.yaml, model.yaml or config.json)."
        )

    if path.exists():
        raise CheckpointError(f"CHECKPOINT must be a directory or an asset card name, but {path} is a file.")

    card = _asset_store().maybe_retrieve_card(checkpoint)

    if card is None:
        raise CheckpointError(
            f"CHECKPOINT must be an existing directory or a known asset card name, but '{checkpoint}' is neither."
        )

    _check_training_only(step, run_dir, checkpoint)

    return _card_source(card)


def _check_training_only(step: int | None, run_dir: Path | None, checkpoint: object) -> None:
    for option, value in (("--step", step), ("--run-dir", run_dir)):
        if value is not None:
            raise CheckpointError(f"`{option}` applies to fairseq2 training checkpoints only, but {checkpoint} is not one.")  # fmt: skip


def _training_source(checkpoint_dir: Path, step: int | None, run_dir: Path | None = None) -> _Source:
    """:param run_dir: The run's output directory, which holds its
        config.yaml; the directory above the checkpoints if ``None``."""
    # Absolute: the card below names the model directory, which fairseq2
    # refuses as a relative path. Not resolved: the run's config.yaml is above
    # a `checkpoints` link, not above its target.
    checkpoint_dir = checkpoint_dir.absolute()

    steps = sorted(
        int(match[1])
        for child in checkpoint_dir.iterdir()
        if (match := _STEP_DIR.fullmatch(child.name)) and (child / "model").is_dir()
    )

    if not steps:
        raise CheckpointError(
            f"The checkpoint directory {checkpoint_dir} must hold at least one checkpoint (a step_N/model directory), but has none."
        )

    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(
            f"`--step` must be a step saved in {checkpoint_dir} ({', '.join(map(str, steps))}), but is {step} instead."
        )

    metadata_file = checkpoint_dir / "model.yaml"

    try:
        metadata = yaml.safe_load(metadata_file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as ex:
        raise CheckpointError(f"{metadata_file} cannot be read: {ex}") from None

    if not isinstance(metadata, dict):
        raise CheckpointError(f"{metadata_file} must hold a mapping, but does not.")

    family = _get_family(metadata.get("model_family"), str(metadata_file))

    model_dir = checkpoint_dir / f"step_{step}" / "model"

    # The card fairseq2 itself makes of a checkpoint (`checkpoint_step_N`),
    # so that the config is read and validated the way training wrote it.
    card = AssetCard(
        f"checkpoint_step_{step}",
        {
            "name": f"checkpoint_step_{step}",
            "model_family": family.name,
            "model_config": metadata.get("model_config"),
            "checkpoint": str(model_dir),
        },
    )

    config = _get_config(family, card)

    if run_dir is None:
        run_dir = checkpoint_dir.parent

    has_run_config = (run_dir / "config.yaml").is_file()

    default_base = _run_base(run_dir) if has_run_config else None

    if default_base is not None:
        log.info("The run in {} started from {}.", run_dir, default_base)

    default_tokenizer = _run_tokenizer_dir(run_dir) if has_run_config else None

    # A LoRA run by its config.yaml (a record may be left over from a LoRA
    # run that never saved a checkpoint), or by its record where the run's
    # config.yaml is not at hand. The adapters' settings are the record's:
    # fairseq2 rewrites config.yaml each time the run is started, also by a
    # resumption refused for another `lora` section.
    if _run_has_lora(run_dir) if has_run_config else (checkpoint_dir / LORA_BASE_FILE).is_file():
        try:
            lora_base = load_lora_base(checkpoint_dir)
        except LoraBaseError as ex:
            raise CheckpointError(str(ex)) from None
    else:
        lora_base = None

    return _Source(
        f"step {step} of {checkpoint_dir}",
        family,
        config,
        model_dir,
        default_base,
        default_tokenizer,
        lora_base,
        unrecorded_run=None if has_run_config else run_dir,
    )


def _hf_source(path: Path) -> _Source:
    try:
        config = qwen35_config_from_hf(load_hf_config(path))
    except (FileNotFoundError, ValueError) as ex:
        raise CheckpointError(f"{path} is not a Qwen3.5 Hugging Face model: {ex}") from None

    try:
        keys = index_safetensors(path).keys()
    except CorruptModelCheckpointError as ex:
        raise CheckpointError(str(ex)) from None

    config = drop_absent_mtp_head(config, keys, path)

    family_name = _family_name_of(config)

    family = _get_family(family_name, str(path))

    return _Source(str(path), family, config, path, path)


def _card_source(card: AssetCard) -> _Source:
    family_field = card.maybe_get_field("model_family")

    family = _get_family(
        None if family_field is None else family_field.as_(str), f"the {card.name} asset card"
    )

    config = _get_config(family, card)

    path = _download_checkpoint(card)

    default_base = path if (path / "config.json").is_file() else None

    return _Source(f"the {card.name} model", family, config, path, default_base)


def _family_name_of(config: Qwen35Config) -> str:
    return QWEN35_MOE_FAMILY if isinstance(config, Qwen35MoeConfig) else QWEN35_FAMILY


def _model_hub(source: _Source) -> ModelHub[torch.nn.Module, object]:
    return ModelHub(source.family, _asset_store())


def _asset_store() -> AssetStore:
    return get_dependency_resolver().resolve(AssetStore)  # type: ignore[type-abstract]


def _get_family(name: object, where: str) -> ModelFamily:
    if name not in EXPORTABLE_FAMILIES:
        raise CheckpointError(
            f"The model family of {where} must be one of {', '.join(EXPORTABLE_FAMILIES)}, but is {name!r} instead."
        )

    family = get_dependency_resolver().maybe_resolve(ModelFamily, key=name)  # type: ignore[type-abstract]

    if family is None:
        raise CheckpointError(f"The {name} model family is not registered; is qwen35-fs2 installed?")

    return family


def _get_config(family: ModelFamily, card: AssetCard) -> Qwen35Config:
    try:
        config = family.get_model_config(card)
    except Exception as ex:
        raise CheckpointError(f"The model configuration of {card.name} cannot be read: {ex}") from ex

    if not isinstance(config, Qwen35Config):
        raise CheckpointError(
            f"The configuration of {card.name} must be a `Qwen35Config`, but is a `{type(config).__name__}` instead."
        )

    return config


def _download_checkpoint(card: AssetCard) -> Path:
    """Returns the local directory of the ``checkpoint`` of ``card``,
    downloading it if needed."""
    try:
        uri = card.field("checkpoint").as_uri()

        if uri.scheme == "file":
            path = uri.to_path()
        else:
            path = get_asset_download_manager().download_model(uri)
    except Exception as ex:
        raise CheckpointError(f"The checkpoint of the {card.name} asset card cannot be found: {ex}") from ex

    if not path.is_dir():
        raise CheckpointError(
            f"The checkpoint of the {card.name} asset card must be a directory, but {path} is not."
        )

    return path


def _resolve_base(base: str) -> Path:
    path = Path(base)

    if path.is_dir():
        return path

    if path.exists():
        raise CheckpointError(f"`--base` must be a directory or an asset card name, but {path} is a file.")

    card = _asset_store().maybe_retrieve_card(base)

    if card is None:
        raise CheckpointError(
            f"`--base` must be an existing Hugging Face model directory or a known asset card name, but '{base}' is neither."
        )

    path = _download_checkpoint(card)

    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"`--base` must be a Hugging Face model, but the checkpoint of the {card.name} asset card ({path}) has no config.json."
        )

    return path


def _resolve_tokenizer_dir(tokenizer: str) -> Path:
    """Returns the Hugging Face tokenizer directory named by ``--tokenizer``:
    a directory or a tokenizer asset card."""
    path = Path(tokenizer)

    if path.is_dir():
        return path

    card = _asset_store().maybe_retrieve_card(tokenizer)

    if card is None or not card.has_field("tokenizer"):
        raise CheckpointError(
            f"`--tokenizer` must be a tokenizer directory or the name of a tokenizer asset card, but '{tokenizer}' is neither."
        )

    return _tokenizer_dir_of_card(card)


def _tokenizer_dir_of_card(card: AssetCard) -> Path:
    if card.name == QWEN35_TOKENIZER_ASSET:
        # Built offline on first use.
        return get_qwen35_tokenizer_dir()

    try:
        uri = card.field("tokenizer").as_uri()

        if uri.scheme == "file":
            path = uri.to_path()
        else:
            path = get_asset_download_manager().download_tokenizer(uri)
    except Exception as ex:
        raise CheckpointError(f"The tokenizer of the {card.name} asset card cannot be found: {ex}") from ex

    return path if path.is_dir() else path.parent


def _run_tokenizer_dir(run_dir: Path) -> Path | None:
    """Returns the tokenizer directory a training run used, as its
    ``config.yaml`` records it; ``None`` if it cannot be told."""
    try:
        run_config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None

    section = run_config.get("tokenizer") if isinstance(run_config, dict) else None

    if not isinstance(section, dict):
        return None

    path = section.get("path")

    if isinstance(path, str) and Path(path).is_dir():
        return Path(path)

    name = section.get("name")

    card = _asset_store().maybe_retrieve_card(name) if isinstance(name, str) else None

    if card is None or not card.has_field("tokenizer"):
        return None

    return _tokenizer_dir_of_card(card)


def _run_has_lora(run_dir: Path) -> bool:
    """Returns whether the ``config.yaml`` of a training run has a ``lora``
    section."""
    config_file = run_dir / "config.yaml"

    try:
        run_config = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as ex:
        raise CheckpointError(f"{config_file} cannot be read: {ex}") from None

    return isinstance(run_config, dict) and run_config.get("lora") is not None


def _run_base(run_dir: Path) -> Path | None:
    """Returns the Hugging Face model a training run started from, as its
    ``config.yaml`` records it, following runs that continued an earlier
    run's checkpoint; ``None`` if it started from anything else."""
    config_file = run_dir / "config.yaml"

    try:
        run_config = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as ex:
        raise CheckpointError(f"{config_file} cannot be read: {ex}") from None

    if not isinstance(run_config, dict):
        raise CheckpointError(f"{config_file} must hold a recipe configuration, but does not.")

    model_section = run_config.get("model")

    if not isinstance(model_section, dict):
        return None

    model_path = model_section.get("path")

    if model_path is not None:
        path = Path(model_path)

        if not path.exists():
            raise CheckpointError(
                f"The run in {run_dir} started from {path}, whose Hugging Face files the export carries over, but it does not exist anymore. Pass `--base DIR` or `--no-base`."
            )

        return path if (path / "config.json").is_file() else None

    name = model_section.get("name")

    if not isinstance(name, str):
        return None

    card = _asset_store().maybe_retrieve_card(name)

    if card is None:
        # The `checkpoint_step_N` cards of `common.assets.prev_checkpoint_dir`.
        assets = (run_config.get("common") or {}).get("assets") or {}

        prev_checkpoint_dir = assets.get("prev_checkpoint_dir")

        if prev_checkpoint_dir is not None and _FAIRSEQ2_CHECKPOINT_CARD.fullmatch(name):
            prev_run_dir = Path(prev_checkpoint_dir).parent

            if (prev_run_dir / "config.yaml").is_file():
                return _run_base(prev_run_dir)

        raise CheckpointError(
            f"The run in {run_dir} started from the {name} model, which is not a known asset card here, so the Hugging Face model to carry over is unknown. Pass `--base DIR` or `--no-base`."
        )

    if not card.has_field("checkpoint"):
        return None

    try:
        path = _download_checkpoint(card)
    except CheckpointError as ex:
        raise CheckpointError(
            f"The run in {run_dir} started from the {name} model, whose Hugging Face files the export carries over, but they cannot be found: {ex} Pass `--base DIR` or `--no-base`."
        ) from None

    return path if (path / "config.json").is_file() else None
