"""Keeps ``hg://`` checkpoints of tests off the network and out of the
user's Hugging Face Hub cache."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest


def use_offline_hub_cache(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    """Makes ``huggingface_hub`` resolve downloads offline against
    ``cache_dir`` only, for the rest of the test: ``hg://`` checkpoints are
    then what the test lays out there, and absent otherwise."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
