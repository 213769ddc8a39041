"""Checkpoints with an MTP head as the released ones have it, made from the
reference harness's tiny checkpoints (whose ``mtp.*`` tensors transformers
neither models nor counts in its config.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from hf_reference import read_safetensors_dir

NESTED_PREFIX = "model.language_model."
"""The prefix of the MTP head in some re-exports."""


def with_mtp_config(base_dir: Path, out_dir: Path, *, nested: bool = False, mtp: bool = True) -> Path:
    """Copies the checkpoint ``base_dir`` (built with ``add_mtp=True``) to
    ``out_dir`` with ``mtp_num_hidden_layers: 1`` in its config.json, as
    the released config.json files have it, its MTP head under
    ``model.language_model.mtp.`` if ``nested``, and without the head's
    tensors unless ``mtp`` (what transformers' ``save_pretrained`` leaves);
    returns ``out_dir``."""
    out_dir.mkdir()

    for file in base_dir.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, out_dir / file.name)

    config = json.loads((base_dir / "config.json").read_text())

    config.get("text_config", config)["mtp_num_hidden_layers"] = 1

    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

    tensors = {}

    for key, tensor in read_safetensors_dir(base_dir).items():
        if key.startswith("mtp."):
            if not mtp:
                continue

            if nested:
                key = NESTED_PREFIX + key

        tensors[key] = tensor.contiguous()

    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})

    return out_dir
