"""The files of a Hugging Face Hub checkpoint that fairseq2 does not download
(it takes the safetensors alone) come from the Hub into its cache: the
``config.json`` and, for a vision-language repository, its processor
configs, which an export of a model trained from it needs.

The Hub cannot be reached here: the cache is laid out as ``huggingface_hub``
lays out a download, and a stand-in answers what would go over the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub.errors import EntryNotFoundError

import qwen35_fs2.hf.config
from fairseq2.assets import AssetCard

from offline_hub import add_hub_snapshot, use_offline_hub_cache
from qwen35_fs2.hf.config import VISION_PROCESSOR_FILES, find_checkpoint_hf_config

_REPO = "test-org/tiny"


def _snapshot(hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty snapshot of the repository in the cache (its safetensors,
    which fairseq2 downloads, play no part here)."""
    files_dir = tmp_path / "files"

    files_dir.mkdir()

    use_offline_hub_cache(monkeypatch, hub_cache)

    return add_hub_snapshot(hub_cache, _REPO, files_dir)


def _serve(snapshot: Path, files: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Answers the downloads of files that the cache lacks as the Hub would:
    ``files`` into the snapshot, the others 404; returns the names asked
    for."""
    hub_download = qwen35_fs2.hf.config.hf_hub_download

    requested: list[str] = []

    def download(repo_id: str, filename: str, **kwargs: object) -> str:
        if kwargs.get("local_files_only"):
            return hub_download(repo_id, filename, **kwargs)  # type: ignore[arg-type]

        assert repo_id == _REPO

        requested.append(filename)

        if filename not in files:
            raise EntryNotFoundError("404 Client Error: Entry Not Found")

        (snapshot / filename).write_text(files[filename])

        return str(snapshot / filename)

    monkeypatch.setattr(qwen35_fs2.hf.config, "hf_hub_download", download)

    return requested


def _card() -> AssetCard:
    return AssetCard("tiny", {"name": "tiny", "model_family": "qwen35", "model_arch": "qwen35_tiny", "checkpoint": f"hg://{_REPO}"})


_VLM_CONFIG = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}, "vision_config": {"model_type": "qwen3_5"}}


def test_a_vision_language_checkpoint_brings_the_processor_files_it_has(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = _snapshot(tmp_path / "hub", tmp_path, monkeypatch)

    requested = _serve(snapshot, {"config.json": json.dumps(_VLM_CONFIG), "preprocessor_config.json": '{"patch_size": 16}'}, monkeypatch)

    assert find_checkpoint_hf_config(_card()) == snapshot / "config.json"

    # With the config, each processor file was asked for.
    assert requested == ["config.json", *VISION_PROCESSOR_FILES]

    assert (snapshot / "preprocessor_config.json").read_text() == '{"patch_size": 16}'

    # Later runs read the cached config and ask for nothing (a node without
    # network would retry each request for half a minute).
    requested.clear()

    find_checkpoint_hf_config(_card())

    assert requested == []


def test_a_text_only_checkpoint_asks_for_no_processor_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = _snapshot(tmp_path / "hub", tmp_path, monkeypatch)

    requested = _serve(snapshot, {"config.json": json.dumps({"model_type": "qwen3_5_text"})}, monkeypatch)

    assert find_checkpoint_hf_config(_card()) == snapshot / "config.json"

    assert requested == ["config.json"]
