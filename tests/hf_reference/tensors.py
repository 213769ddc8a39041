"""Reads the tensors of a Hugging Face model directory, for comparisons."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from torch import Tensor


def read_safetensors_dir(model_dir: Path) -> dict[str, Tensor]:
    """Returns every tensor of the ``*.safetensors`` files of ``model_dir``."""
    tensors = {}

    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as reader:
            for key in reader.keys():
                tensors[key] = reader.get_tensor(key)

    return tensors
