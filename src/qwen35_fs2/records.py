"""The small YAML records that our recipes keep beside fairseq2's
checkpoints (the base and adapters of a LoRA run, the settings a resumed
run restores)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml


def write_record(file: Path, record: dict[str, object]) -> None:
    """Writes ``record`` to the YAML file ``file``, replacing it whole or
    leaving it as it was: a run stopped while writing it must not leave a
    half-written record that its resumption reads."""
    file.parent.mkdir(parents=True, exist_ok=True)

    tmp_file = file.with_name(f"{file.name}.tmp")

    tmp_file.write_text(yaml.safe_dump(record, sort_keys=False), encoding="utf-8")

    os.replace(tmp_file, file)
