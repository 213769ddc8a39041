"""The MTP head goes from a Hugging Face checkpoint into our model and back
out bit for bit: both key layouts of the head (``mtp.*`` and the
``model.language_model.mtp.*`` of some re-exports), dense and MoE, without a
base (text-only, per-expert experts) and with one (the base's layout and
dtype). The model's head is exported, not the base's, unless asked.

The checkpoints are transformers 5.24's tiny models with the released
checkpoints' ``mtp.*`` tensors added by the reference harness (transformers
neither models nor saves them), and ``mtp_num_hidden_layers: 1`` added to
their config.json here, as the released config.json files have it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor

from huggingface_hub.errors import EntryNotFoundError

from fairseq2.assets import AssetCard, AssetCardError

from export_testing import DENSE_VLM, DENSE_VLM_BF16_TIED, MOE_VLM, read_config
from hf_reference import TinyQwen35Spec, read_safetensors_dir
from mtp_testing import NESTED_PREFIX, with_mtp_config
from offline_hub import add_hub_snapshot, use_offline_hub_cache
import qwen35_fs2.hf.config
from qwen35_fs2 import load_hf_model, qwen35_config_from_hf, save_hf_model
from qwen35_fs2.hf.safetensors import index_safetensors
from qwen35_fs2.models.qwen35 import get_qwen35_model_hub
from qwen35_fs2.nn.mtp import Qwen35MultiTokenPredictor

pytestmark = pytest.mark.slow


def _mtp_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The MTP head of a checkpoint, in either layout, under ``mtp.``."""
    return {k.removeprefix(NESTED_PREFIX): v for k, v in tensors.items() if k.removeprefix(NESTED_PREFIX).startswith("mtp.")}


def _per_expert(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Splits fused expert tensors (``gate_up_proj`` ``[E, 2I, H]``, gate rows
    first; ``down_proj`` ``[E, H, I]``) into transformers' per-expert
    tensors, as an export without a base writes them."""
    output = {}

    for key, tensor in tensors.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")

            inner_dim = tensor.size(1) // 2

            for e in range(tensor.size(0)):
                output[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :inner_dim]
                output[f"{prefix}{e}.up_proj.weight"] = tensor[e, inner_dim:]
        elif key.endswith(".mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")

            for e in range(tensor.size(0)):
                output[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        else:
            output[key] = tensor

    return output


def _assert_bitwise_equal(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys(), f"Missing: {sorted(expected.keys() - actual.keys())}. Extra: {sorted(actual.keys() - expected.keys())}."

    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key

        assert torch.equal(actual[key].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), key


_SPECS = {"dense": DENSE_VLM, "moe-fused": MOE_VLM}


class TestMtpRoundTrip:
    @pytest.mark.parametrize("nested", [False, True], ids=["mtp", "language-model-mtp"])
    @pytest.mark.parametrize("spec", _SPECS.values(), ids=_SPECS.keys())
    def test_export_without_base_keeps_every_mtp_tensor(
        self, spec: TinyQwen35Spec, nested: bool, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path
    ) -> None:
        checkpoint = with_mtp_config(base_dirs[spec], tmp_path / "ckpt", nested=nested)

        model = load_hf_model(checkpoint)

        assert isinstance(model.mtp, Qwen35MultiTokenPredictor)

        config = qwen35_config_from_hf(read_config(checkpoint))

        save_hf_model(model, tmp_path / "out", config=config)

        expected = _per_expert(_mtp_tensors(read_safetensors_dir(checkpoint)))

        actual = read_safetensors_dir(tmp_path / "out")

        # Text-only: the head is at the top level.
        _assert_bitwise_equal({k: v for k, v in actual.items() if k.startswith("mtp.")}, expected)

        assert not any(k.startswith(NESTED_PREFIX) for k in actual)

        assert read_config(tmp_path / "out")["mtp_num_hidden_layers"] == 1

    @pytest.mark.parametrize("nested", [False, True], ids=["mtp", "language-model-mtp"])
    @pytest.mark.parametrize("spec", [DENSE_VLM_BF16_TIED, MOE_VLM], ids=["dense-bf16-tied", "moe-fused"])
    def test_export_with_base_writes_the_head_in_the_layout_and_dtype_of_the_base(
        self, spec: TinyQwen35Spec, nested: bool, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path
    ) -> None:
        checkpoint = with_mtp_config(base_dirs[spec], tmp_path / "ckpt", nested=nested)

        # Loaded in fp32 whatever the checkpoint's dtype.
        model = load_hf_model(checkpoint, dtype=torch.float32)

        save_hf_model(model, tmp_path / "out", base=checkpoint)

        expected = read_safetensors_dir(checkpoint)

        actual = read_safetensors_dir(tmp_path / "out")

        _assert_bitwise_equal(actual, expected)

        assert read_config(tmp_path / "out")["text_config"]["mtp_num_hidden_layers"] == 1

    def test_export_with_base_writes_the_models_head_unless_asked_for_the_bases(
        self, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path
    ) -> None:
        checkpoint = with_mtp_config(base_dirs[DENSE_VLM], tmp_path / "ckpt", nested=False)

        model = load_hf_model(checkpoint)

        with torch.no_grad():
            model.mtp.fc.weight.add_(1.0)
            model.mtp.layers[0].ffn.output_proj.weight.mul_(2.0)

        base = read_safetensors_dir(checkpoint)

        save_hf_model(model, tmp_path / "trained", base=checkpoint)

        trained = read_safetensors_dir(tmp_path / "trained")

        torch.testing.assert_close(trained["mtp.fc.weight"], base["mtp.fc.weight"] + 1.0, rtol=0, atol=0)
        torch.testing.assert_close(trained["mtp.layers.0.mlp.down_proj.weight"], base["mtp.layers.0.mlp.down_proj.weight"] * 2.0, rtol=0, atol=0)

        save_hf_model(model, tmp_path / "kept", base=checkpoint, keep_base_mtp=True)

        kept = read_safetensors_dir(tmp_path / "kept")

        _assert_bitwise_equal(_mtp_tensors(kept), _mtp_tensors(base))

    def test_checkpoint_without_the_tensors_loads_without_the_head_and_exports_none(
        self, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        # What transformers' `save_pretrained` leaves: the config's count,
        # no tensors.
        checkpoint = with_mtp_config(base_dirs[DENSE_VLM], tmp_path / "ckpt", nested=False, mtp=False)

        with caplog.at_level(logging.INFO):
            model = load_hf_model(checkpoint)

        assert not hasattr(model, "mtp")

        assert "has no MTP head" in caplog.text

        save_hf_model(model, tmp_path / "out", base=checkpoint)

        assert not any(k.startswith("mtp.") for k in read_safetensors_dir(tmp_path / "out"))

        assert read_config(tmp_path / "out")["text_config"]["mtp_num_hidden_layers"] == 0


class TestHubCheckpointWithoutTheHead:
    """An ``hg://`` card of a checkpoint whose config.json counts an MTP head
    that its safetensors lack (transformers' ``save_pretrained``) gets the
    same configuration on its first run, when the Hub cache holds only the
    config.json (fairseq2 downloads the safetensors after the configuration
    is made), as on the later ones: without the head."""

    _REPO = "test-org/saved"

    def _card(self) -> AssetCard:
        metadata = {"name": "saved", "model_family": "qwen35", "model_arch": "qwen35_tiny", "checkpoint": f"hg://{self._REPO}"}

        return AssetCard("saved", metadata)

    def _config_only_snapshot(self, checkpoint: Path, hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
        files_dir = checkpoint.parent / "config_only"
        files_dir.mkdir()

        shutil.copy(checkpoint / "config.json", files_dir)

        use_offline_hub_cache(monkeypatch, hub_cache)

        return add_hub_snapshot(hub_cache, self._REPO, files_dir)

    @pytest.mark.parametrize("layout", ["one_file", "sharded"])
    def test_first_run_reads_the_tensor_names_from_the_hub_and_loads_without_the_head(
        self, layout: str, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        checkpoint = with_mtp_config(base_dirs[DENSE_VLM], tmp_path / "ckpt", mtp=False)

        snapshot_dir = self._config_only_snapshot(checkpoint, tmp_path / "hub", monkeypatch)

        weight_map = {key: "model.safetensors" for key in index_safetensors(checkpoint)}

        # The Hub cannot be reached here. It answers a request for the index
        # of a checkpoint of one file with "not found" (huggingface_hub's
        # `get_safetensors_metadata` then reads the file's header over HTTP),
        # and sends a sharded checkpoint's index into the cache.
        index_file = tmp_path / "downloaded_index.json"

        index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

        hub_download = qwen35_fs2.hf.config.hf_hub_download

        def download(repo_id: str, filename: str, **kwargs: object) -> str:
            if filename != "model.safetensors.index.json" or kwargs.get("local_files_only"):
                return hub_download(repo_id, filename, **kwargs)  # type: ignore[arg-type]

            assert repo_id == self._REPO

            if layout == "one_file":
                raise EntryNotFoundError("404 Client Error: Entry Not Found")

            return str(index_file)

        def hub_metadata(repo_id: str) -> SimpleNamespace:
            assert repo_id == self._REPO and layout == "one_file"

            return SimpleNamespace(weight_map=weight_map)

        monkeypatch.setattr(qwen35_fs2.hf.config, "hf_hub_download", download)

        monkeypatch.setattr(qwen35_fs2.hf.config, "get_safetensors_metadata", hub_metadata)

        hub = get_qwen35_model_hub()

        with caplog.at_level(logging.INFO, logger="fairseq2"):
            first_config = hub.get_model_config(self._card())

        assert first_config.mtp_num_layers == 0

        assert "has no MTP head" in caplog.text

        # fairseq2's download; from here on the cache answers.
        shutil.copy(checkpoint / "model.safetensors", snapshot_dir)

        monkeypatch.setattr(qwen35_fs2.hf.config, "get_safetensors_metadata", None)

        monkeypatch.setattr(qwen35_fs2.hf.config, "hf_hub_download", hub_download)

        assert hub.get_model_config(self._card()) == first_config

        model = hub.load_model(self._card(), device=torch.device("cpu"), dtype=torch.float32, config=first_config)

        assert not hasattr(model, "mtp")

        expected = read_safetensors_dir(checkpoint)["model.language_model.embed_tokens.weight"]

        assert torch.equal(model.decoder_frontend.embed.weight, expected)  # type: ignore[union-attr, arg-type]

    def test_a_cached_index_is_read_before_an_incomplete_download(
        self, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A sharded checkpoint whose download stopped after the index and the
        # shard without the head: the head is in the index.
        checkpoint = with_mtp_config(base_dirs[DENSE_VLM], tmp_path / "ckpt")

        tensors = read_safetensors_dir(checkpoint)

        snapshot_dir = self._config_only_snapshot(checkpoint, tmp_path / "hub", monkeypatch)

        weight_map = {key: "model-0000{}-of-00002.safetensors".format(2 if key.startswith("mtp.") else 1) for key in tensors}

        (snapshot_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

        save_file({k: v.contiguous() for k, v in tensors.items() if not k.startswith("mtp.")}, snapshot_dir / "model-00001-of-00002.safetensors")

        assert get_qwen35_model_hub().get_model_config(self._card()).mtp_num_layers == 1

        (snapshot_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))

        with pytest.raises(AssetCardError, match=r"must be a JSON object with a `weight_map` object, but is not"):
            get_qwen35_model_hub().get_model_config(self._card())

    def test_offline_without_a_cached_checkpoint_warns_and_keeps_the_config_json(
        self, base_dirs: dict[TinyQwen35Spec, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        checkpoint = with_mtp_config(base_dirs[DENSE_VLM], tmp_path / "ckpt", mtp=False)

        self._config_only_snapshot(checkpoint, tmp_path / "hub", monkeypatch)

        with caplog.at_level(logging.WARNING, logger="fairseq2"):
            config = get_qwen35_model_hub().get_model_config(self._card())

        assert config.mtp_num_layers == 1

        assert f"The tensor names of hg://{self._REPO} cannot be had before fairseq2 downloads it" in caplog.text
