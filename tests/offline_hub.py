"""Keeps ``hg://`` checkpoints of tests off the network and out of the
user's Hugging Face Hub cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Final, Literal

import huggingface_hub.constants
import pytest

HUB_COMMIT: Final = "0123456789abcdef0123456789abcdef01234567"
"""The commit of every snapshot laid out here (40 hex digits, as the Hub's)."""


def use_offline_hub_cache(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    """Makes ``huggingface_hub`` resolve downloads offline against
    ``cache_dir`` only, for the rest of the test: ``hg://`` checkpoints are
    then what the test lays out there, and absent otherwise."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def add_hub_snapshot(
    cache_dir: Path, repo_id: str, files_dir: Path, *, repo_type: Literal["model", "dataset"] = "model"
) -> Path:
    """Lays out the files of ``files_dir`` as the ``main`` revision of the
    Hub repository ``repo_id`` in the Hub cache ``cache_dir``, as
    ``huggingface_hub`` lays out a download (hard links, so that large
    checkpoints cost nothing to add). Returns the snapshot directory."""
    repo_dir = cache_dir / f"{repo_type}s--{repo_id.replace('/', '--')}"

    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)

    (repo_dir / "refs" / "main").write_text(HUB_COMMIT)

    snapshot_dir = repo_dir / "snapshots" / HUB_COMMIT

    shutil.copytree(files_dir, snapshot_dir, copy_function=_link_or_copy)

    return snapshot_dir


def offline_hub_env(cache_dir: Path) -> dict[str, str]:
    """The environment variables that make a process resolve ``hg://``
    checkpoints and datasets offline against ``cache_dir`` only."""
    return {"HF_HUB_CACHE": str(cache_dir), "HF_HUB_OFFLINE": "1"}


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
