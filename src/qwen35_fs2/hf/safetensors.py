"""The tensors of safetensors files, read from their headers only: where
each lies, its dtype and its shape."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Final, final

import torch

from fairseq2.model_checkpoint import CorruptModelCheckpointError

_SAFETENSORS_DTYPES: Final = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@final
@dataclass(frozen=True)
class SafetensorsTensor:
    """Where a tensor lies in a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """The byte offset of its data in :attr:`file`."""

    @property
    def num_rows(self) -> int:
        return matrix_rows(self.shape)

    @property
    def num_cols(self) -> int:
        return matrix_cols(self.shape)


def matrix_rows(shape: tuple[int, ...]) -> int:
    """The rows of ``shape`` viewed as 2-D: all dimensions but the last."""
    return prod(shape[:-1]) if len(shape) > 1 else prod(shape)


def matrix_cols(shape: tuple[int, ...]) -> int:
    """The columns of ``shape`` viewed as 2-D: its last dimension."""
    return shape[-1] if len(shape) > 1 else 1


SAFETENSORS_INDEX_FILE: Final = "model.safetensors.index.json"
"""The index of a Hugging Face checkpoint in safetensors: the file of each
tensor."""


def read_safetensors_weight_map(index_file: Path) -> dict[str, str]:
    """Returns the ``weight_map`` of the safetensors index ``index_file``:
    the file of each tensor, by name.

    :raises ValueError: ``index_file`` holds no such index (the message says
        why).
    """
    try:
        document = json.loads(index_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as ex:
        raise ValueError(f"it is not JSON: {ex}") from None

    weight_map = document.get("weight_map") if isinstance(document, dict) else None

    if not isinstance(weight_map, dict):
        raise ValueError("it has no `weight_map` object")

    return weight_map


def index_safetensors(
    path: Path, files: Sequence[Path] | None = None
) -> dict[str, SafetensorsTensor]:
    """Reads the headers of the safetensors files of the directory ``path``
    (only the headers: no tensor data).

    :param files: The files to read; all ``*.safetensors`` files of ``path``
        if ``None``.
    """
    if files is None:
        files = sorted(path.glob("*.safetensors"))

    if not files:
        raise CorruptModelCheckpointError(
            path, f"{path} must contain safetensors checkpoint files, but has none."
        )

    index: dict[str, SafetensorsTensor] = {}

    for file in files:
        for key, tensor in _read_safetensors_header(file).items():
            if key in index:
                raise CorruptModelCheckpointError(
                    path, f"`{key}` must be in one safetensors file of {path}, but is in {index[key].file.name} and {file.name}."
                )

            index[key] = tensor

    return index


def _read_safetensors_header(file: Path) -> dict[str, SafetensorsTensor]:
    def corrupt(reason: str) -> CorruptModelCheckpointError:
        return CorruptModelCheckpointError(
            file, f"{file} cannot be loaded as a safetensors checkpoint file: {reason}"
        )

    file_size = file.stat().st_size

    with file.open("rb") as fp:
        prefix = fp.read(8)

        if len(prefix) != 8:
            raise corrupt("the file is shorter than its header.")

        (header_size,) = struct.unpack("<Q", prefix)

        if 8 + header_size > file_size:
            raise corrupt("the file is shorter than its header.")

        try:
            header = json.loads(fp.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError) as ex:
            raise corrupt(f"its header is not valid JSON ({ex}).") from None

    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object.")

    data_start = 8 + header_size

    tensors = {}

    for key, entry in header.items():
        if key == "__metadata__":
            continue

        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]

            shape = tuple(int(size) for size in entry["shape"])

            begin, end = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"the header entry of `{key}` ({entry}) is not a tensor of a supported dtype.") from None

        num_bytes = prod(shape) * dtype.itemsize

        if end - begin != num_bytes or data_start + end > file_size:
            raise corrupt(f"`{key}` must take {num_bytes} bytes within the file, but takes bytes {begin} to {end} of its data.")

        tensors[key] = SafetensorsTensor(file, dtype, shape, data_start + begin)

    return tensors
