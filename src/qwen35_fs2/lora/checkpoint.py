"""The checkpoints of LoRA runs: the adapters and their optimizer state, not
the frozen base, and a record of the base they adapt.

A base is read again from its Hugging Face checkpoint wherever the adapters
are used (a resumed run, an export), so a checkpoint is as large as its
adapters. fairseq2's checkpoint manager saves and loads a model through its
data-parallel facade (:mod:`fairseq2.nn.data_parallel`); the facade of a
LoRA run (:class:`LoraCheckpointFacade`) gives it the adapters alone.

The base is recorded once per run, in ``lora_base.yaml`` next to fairseq2's
``model.yaml`` in the checkpoint directory (:func:`save_lora_base`): its
directory and a fingerprint of its safetensors headers (every tensor's name,
dtype, shape and place in its file), and the adapters' configuration the run
started with. Adapters put on another base would compute something no run
trained, so reading them onto a base of another directory or fingerprint is
an error (:func:`check_lora_base`). The fingerprint tells a base of another
architecture, dtype or layout and a re-saved one apart; it reads no tensor
data, so weights overwritten in place with others of the same shapes go
unnoticed.

The adapters' configuration is recorded because fairseq2 rewrites the run's
``config.yaml`` whenever the run is started again: a resumed run with another
``alpha`` or ``rslora`` would scale the same adapters differently, and every
earlier checkpoint would then be exported with the new scale. A resumed
run's configuration must be the recorded one (:func:`check_lora_config`),
and exports take the recorded one.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final, final

import yaml
from typing_extensions import override

from fairseq2.error import StateDictError
from fairseq2.utils.validation import StandardObjectValidator, ValidationError

from qwen35_fs2.hf.safetensors import index_safetensors
from qwen35_fs2.lora.config import LoraConfig
from qwen35_fs2.nn.lora import is_lora_key
from qwen35_fs2.records import write_record
from qwen35_fs2.parallel.facade import DelegatingFacade

LORA_BASE_FILE: Final = "lora_base.yaml"
"""The record of a LoRA run's base, in its checkpoint directory."""


class LoraBaseError(Exception):
    """Raised when the record of a LoRA run's base is missing or unreadable,
    or names another base than the one given."""


@final
@dataclass(frozen=True)
class LoraBase:
    """The Hugging Face checkpoint that a LoRA run's adapters adapt."""

    path: Path
    """Its directory, absolute."""

    fingerprint: str
    """The SHA-256 of its safetensors headers (:func:`fingerprint_hf_checkpoint`)."""

    lora: LoraConfig
    """The configuration of the adapters the run put on it."""


def fingerprint_hf_checkpoint(path: Path) -> str:
    """Returns the SHA-256 of the headers of the safetensors files of the
    Hugging Face checkpoint directory ``path``: every tensor's key, file,
    dtype, shape and offset, in key order. It reads no tensor data."""
    digest = hashlib.sha256()

    for key, tensor in sorted(index_safetensors(path).items()):
        digest.update(f"{key}\0{tensor.file.name}\0{tensor.dtype}\0{tensor.shape}\0{tensor.offset}\n".encode())

    return digest.hexdigest()


def describe_lora_base(path: Path, lora: LoraConfig) -> LoraBase:
    """Returns the record of the Hugging Face checkpoint directory ``path``
    as the base of a LoRA run with the adapters of ``lora``."""
    return LoraBase(path.resolve(), fingerprint_hf_checkpoint(path), lora)


def save_lora_base(checkpoint_dir: Path, base: LoraBase) -> None:
    """Records ``base`` as the base of the LoRA run of ``checkpoint_dir``,
    replacing any earlier record. The file is written whole or not at all."""
    write_record(checkpoint_dir / LORA_BASE_FILE, {"path": str(base.path), "fingerprint": base.fingerprint, "lora": asdict(base.lora)})


def load_lora_base(checkpoint_dir: Path) -> LoraBase:
    """Returns the base recorded for the LoRA run of ``checkpoint_dir``.

    :raises LoraBaseError: if there is no record, or it cannot be read.
    """
    file = checkpoint_dir / LORA_BASE_FILE

    try:
        record = yaml.safe_load(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraBaseError(
            f"The checkpoints in {checkpoint_dir} must have a record of the base model their LoRA adapters adapt ({LORA_BASE_FILE}), but have none. "
            "Checkpoints of LoRA runs hold the adapters alone, and the run that saved them wrote the record when it started."
        ) from None
    except (OSError, yaml.YAMLError) as ex:
        raise LoraBaseError(f"{file} cannot be read: {ex}") from None

    if not isinstance(record, dict) or not isinstance(record.get("path"), str) or not isinstance(record.get("fingerprint"), str):
        raise LoraBaseError(f"{file} must hold the `path` and `fingerprint` of a base model and the `lora` configuration of its adapters, but does not.")

    if not isinstance(record.get("lora"), dict):
        raise LoraBaseError(
            f"{file} must hold the `lora` configuration the adapters were trained with, but was written by an earlier version, which recorded the base alone. "
            "Add the run's `lora` section to it as `lora:` (that of its config.yaml, unless the run was started again with other adapter settings)."
        )

    try:
        lora = LoraConfig(**record["lora"])

        StandardObjectValidator().validate(lora)
    except (TypeError, ValidationError) as ex:
        raise LoraBaseError(f"The `lora` configuration in {file} must be one of LoRA adapters, but is not: {ex}") from None

    return LoraBase(Path(record["path"]), record["fingerprint"], lora)


def check_lora_base(recorded: LoraBase, path: Path) -> None:
    """Checks that the Hugging Face checkpoint directory ``path`` is the
    base ``recorded`` for a LoRA run's adapters: the same directory, with
    the same fingerprint.

    :raises LoraBaseError: if it is not.
    """
    given_path = path.resolve()

    if given_path != recorded.path:
        raise LoraBaseError(
            f"The base model must be the one the LoRA adapters of the checkpoints were trained on, {recorded.path}, but is {given_path} instead. "
            "Set `model.path` (or `model.name`) to that base, or start a new run in another output directory."
        )

    fingerprint = fingerprint_hf_checkpoint(path)

    if fingerprint != recorded.fingerprint:
        raise LoraBaseError(
            f"The base model {given_path} must be the one the LoRA adapters of the checkpoints were trained on, but its safetensors have changed since (their fingerprint is {fingerprint} instead of {recorded.fingerprint}). "
            "Restore that base, or start a new run in another output directory."
        )


# The settings that make what the adapters compute: `dropout_p` acts in
# training alone, and a resumed run may change it.
_LORA_FUNCTION_FIELDS: Final = ("target_modules", "target_parameters", "r", "alpha", "rslora")


def check_lora_config(recorded: LoraBase, lora: LoraConfig) -> None:
    """Checks that ``lora``, the ``lora`` section of a resumed run, puts on
    the adapters that its checkpoints were trained with, as ``recorded``.

    :raises LoraBaseError: if it does not.
    """
    for name in _LORA_FUNCTION_FIELDS:
        value, recorded_value = getattr(lora, name), getattr(recorded.lora, name)

        # The targets in any order put on the same adapters.
        if isinstance(value, list) and isinstance(recorded_value, list):
            differs = sorted(value) != sorted(recorded_value)
        else:
            differs = value != recorded_value

        if differs:
            raise LoraBaseError(
                f"`lora.{name}` must be the one the LoRA adapters of the checkpoints were trained with, {recorded_value}, but is {value} instead. "
                "Set it back to resume the run, or start a new run in another output directory."
            )


@final
class LoraCheckpointFacade(DelegatingFacade):
    """The data-parallel facade of a LoRA model: ``facade``'s, except that
    the model's state is its adapters alone.

    fairseq2's checkpoint manager saves and restores the model through the
    facade of the data-parallel model that the trainer holds; set on that
    model (:func:`~fairseq2.nn.data_parallel.set_data_parallel_facade`), it
    makes checkpoints hold the adapters (each rank's shards of them, under
    FSDP) and leaves the base, read from its own checkpoint, as it is when
    they are restored.
    """

    @override
    def state_dict(self) -> dict[str, object]:
        return {key: value for key, value in self._facade.state_dict().items() if is_lora_key(key)}

    @override
    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        """Loads the adapters of ``state_dict``, which must hold those of the
        model and nothing else.

        :raises StateDictError: if it does not.
        """
        full_state_dict = self._facade.state_dict()

        adapter_keys = {key for key in full_state_dict if is_lora_key(key)}

        missing = sorted(adapter_keys - state_dict.keys())

        unexpected = sorted(state_dict.keys() - adapter_keys)

        if missing or unexpected:
            raise StateDictError(
                f"`state_dict` must hold the LoRA adapters of the model and nothing else, but misses {', '.join(missing) or 'none'} and has {', '.join(unexpected) or 'none'} too."
            )

        # The wrapped facade loads whole states: the base's own tensors
        # stand in for themselves.
        full_state_dict.update(state_dict)

        self._facade.load_state_dict(full_state_dict)
