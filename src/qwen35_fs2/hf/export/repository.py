"""The Hugging Face repository an export is made from (its base), and what
every part of an export shares: its error, its dtypes and the key patterns
of the released layout."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final, Literal, final

import torch
from safetensors import safe_open
from torch import Tensor

from fairseq2.model_checkpoint import CorruptModelCheckpointError

from qwen35_fs2.hf.config import get_text_config, load_hf_config
from qwen35_fs2.hf.safetensors import (
    SAFETENSORS_INDEX_FILE,
    SafetensorsTensor,
    index_safetensors,
    read_safetensors_weight_map,
)

EXPORT_DTYPES: Final = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
"""The dtypes an export can be written in, by their Hugging Face names."""

ExpertLayout = Literal["fused", "per_expert"]

VLM_TEXT_PREFIX: Final = "model.language_model."
"""The prefix of the language model's keys in the released
vision-language layout."""

FUSED_EXPERT_KEY: Final = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")

PER_EXPERT_KEY: Final = re.compile(
    r"^(.*\.mlp\.experts\.)([0-9]+)\.(gate_proj|up_proj|down_proj)\.weight$"
)


class HfExportError(Exception):
    """Raised when an export cannot be made; nothing has been written then."""


@final
class HfRepository:
    """A Hugging Face model directory: its ``config.json`` and the location,
    dtype and shape of each tensor, read from the safetensors headers.

    Tensor data is read only when an export copies it.
    """

    def __init__(
        self, path: Path, config: dict[str, object], tensors: dict[str, SafetensorsTensor]
    ) -> None:
        self.path = path
        self.config = config
        self.tensors = tensors

        # The name of each tensor by its place, for `read`.
        self._keys = {(entry.file, entry.offset): key for key, entry in tensors.items()}

    @staticmethod
    def open(path: str | Path) -> HfRepository:
        path = Path(path)

        if not path.is_dir():
            raise HfExportError(
                f"The base model must be a Hugging Face model directory, but {path} is not a directory."
            )

        try:
            config = load_hf_config(path)
        except (FileNotFoundError, ValueError) as ex:
            raise HfExportError(str(ex)) from None

        try:
            tensors = index_safetensors(path, _safetensors_files(path))
        except (CorruptModelCheckpointError, OSError) as ex:
            raise HfExportError(str(ex)) from None

        return HfRepository(path, config, tensors)

    @property
    def is_vlm(self) -> bool:
        """``True`` for the released vision-language layout."""
        return "text_config" in self.config or any(
            key.startswith(VLM_TEXT_PREFIX) for key in self.tensors
        )

    @property
    def expert_layout(self) -> ExpertLayout | None:
        """How the MoE experts are stored; ``None`` for a dense model."""
        for key in self.tensors:
            if FUSED_EXPERT_KEY.search(key):
                return "fused"

            if PER_EXPERT_KEY.match(key):
                return "per_expert"

        return None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the config declares, else that of most tensor elements."""
        for section in (get_text_config(self.config), self.config):
            for key in ("dtype", "torch_dtype"):
                name = section.get(key)

                if isinstance(name, str) and name in EXPORT_DTYPES:
                    return EXPORT_DTYPES[name]

        counts: dict[torch.dtype, int] = {}

        for entry in self.tensors.values():
            if entry.dtype.is_floating_point:
                counts[entry.dtype] = counts.get(entry.dtype, 0) + numel(entry.shape)

        if not counts:
            raise HfExportError(f"{self.path} must hold floating-point tensors, but has none.")

        return max(counts, key=counts.__getitem__)

    def read(self, entries: Mapping[str, SafetensorsTensor]) -> dict[str, Tensor]:
        """Reads the tensors of ``entries``, entries of this repository, and
        returns them under the names of ``entries``, opening each file once.
        The names may be other than the repository's: a text-only export
        names a nested MTP head's tensors without the ``model.language_model``
        prefix."""
        by_file: dict[Path, list[tuple[str, str]]] = {}

        for name, entry in entries.items():
            by_file.setdefault(entry.file, []).append((name, self._keys[entry.file, entry.offset]))

        tensors = {}

        for file, names in by_file.items():
            with safe_open(file, framework="pt") as reader:
                for name, key in names:
                    tensors[name] = reader.get_tensor(key)

        return tensors


def _safetensors_files(path: Path) -> list[Path]:
    index_file = path / SAFETENSORS_INDEX_FILE

    if index_file.is_file():
        try:
            weight_map = read_safetensors_weight_map(index_file)
        except ValueError as ex:
            raise HfExportError(f"{index_file} must be a safetensors index with a `weight_map`, but cannot be read as one: {ex}.") from None

        return [path / name for name in sorted(set(weight_map.values()))]

    files = sorted(path.glob("*.safetensors"))

    if not files:
        raise HfExportError(
            f"The base model must hold its weights as safetensors, but {path} has no *.safetensors file."
        )

    return files


def numel(shape: tuple[int, ...]) -> int:
    numel = 1

    for dim in shape:
        numel *= dim

    return numel
