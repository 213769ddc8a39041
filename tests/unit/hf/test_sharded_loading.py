"""Loading Hugging Face checkpoints slice by slice gives each rank exactly
its part of what the state-dict converter gives, in every checkpoint layout.

Tensor-parallel ranks are simulated with fake gangs (the loader runs no
collective); FSDP2 shards are checked in
``tests/integration/sharding/test_fsdp2.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor
from tp_testing import fake_tp_gangs

from fairseq2.error import StateDictError
from fairseq2.model_checkpoint import CorruptModelCheckpointError
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import get_shard_dims

from qwen35_fs2.models.qwen35_moe import (
    convert_qwen35_moe_state_dict,
    create_qwen35_moe_model,
)
from qwen35_fs2.models.qwen35 import convert_qwen35_state_dict, create_qwen35_model
from qwen35_fs2.models.qwen35.config import Qwen35Config, tiny_qwen35_config
from qwen35_fs2.hf.export.tensors import lay_out_experts, to_hg_state_dict
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig, tiny_qwen35_moe_config
from qwen35_fs2.hf.sharded_loading import (
    create_sharded_qwen35_model,
    load_hf_checkpoint_shards,
)
from qwen35_fs2.hf.safetensors import index_safetensors

_PACKABLE_KEY = re.compile(r"^(model\.layers\.[0-9]+\.linear_attn\.)in_proj_(qkv|z|b|a)\.weight$")


def _hf_state_dict(config: Qwen35Config, layout: str) -> dict[str, Tensor]:
    """A random model of ``config`` as a Hugging Face state dict in
    ``layout``."""
    torch.manual_seed(0)

    model = create_qwen35_moe_model(config) if isinstance(config, Qwen35MoeConfig) else create_qwen35_model(config)

    with torch.no_grad():
        for param in model.parameters():
            param.normal_()

    hg = to_hg_state_dict(model.state_dict(), config)

    if isinstance(config, Qwen35MoeConfig):
        hg = lay_out_experts(hg, "per_expert" if layout in ("per_expert", "qwen3_next") else "fused")

    if not config.tied_embeddings or layout == "vlm":
        hg["lm_head.weight"] = hg.get("lm_head.weight", hg["model.embed_tokens.weight"])

    if layout == "vlm":
        hg = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v for k, v in hg.items()}

        hg["model.visual.patch_embed.weight"] = torch.zeros(2, 2)
        hg["mtp.fc.weight"] = torch.zeros(2, 2)

    if layout == "qwen3_next":
        hg = _pack_qwen3_next(hg, config)

    if layout == "nested_mtp":
        # The MTP head as some re-exports store it.
        hg = {("model.language_model." + k) if k.startswith("mtp.") else k: v for k, v in hg.items()}

    return {k: v.contiguous() for k, v in hg.items() if isinstance(v, Tensor)}


def _pack_qwen3_next(hg: dict[str, object], config: Qwen35Config) -> dict[str, object]:
    """Packs the Gated DeltaNet projections per key head, as Qwen3-Next
    stores them: ``[q_g | k_g | v_g | z_g]`` and ``[b_g | a_g]``."""
    num_groups = config.num_linear_key_heads

    packed: dict[str, object] = {}

    parts: dict[str, dict[str, Tensor]] = {}

    for key, value in hg.items():
        match = _PACKABLE_KEY.match(key)

        if match is None:
            packed[key] = value
        else:
            assert isinstance(value, Tensor)

            parts.setdefault(match.group(1), {})[match.group(2)] = value

    key_dim = num_groups * config.linear_key_head_dim

    for prefix, tensors in parts.items():
        q, k, v = tensors["qkv"].split_with_sizes([key_dim, key_dim, tensors["z"].size(0)])

        def grouped(*xs: Tensor) -> Tensor:
            return torch.cat([x.view(num_groups, -1, x.size(-1)) for x in xs], dim=1).flatten(0, 1)

        packed[prefix + "in_proj_qkvz.weight"] = grouped(q, k, v, tensors["z"])
        packed[prefix + "in_proj_ba.weight"] = grouped(tensors["b"], tensors["a"])

    return packed


def _save(hg: dict[str, Tensor], path: Path, dtype: torch.dtype) -> None:
    """Saves ``hg`` as two safetensors files, as Hugging Face shards."""
    keys = sorted(hg)

    path.mkdir(parents=True, exist_ok=True)

    for idx, part in enumerate((keys[::2], keys[1::2])):
        save_file({k: hg[k].to(dtype) for k in part}, str(path / f"model-0000{idx + 1}-of-00002.safetensors"))


def _expected_shard(full: Tensor, name: str, shard_dims: dict[str, int], tp_size: int, tp_rank: int) -> Tensor:
    dim = shard_dims.get(name)

    if dim is None:
        return full

    return full.chunk(tp_size, dim=dim)[tp_rank]


def _load(config: Qwen35Config, path: Path, tp_size: int, tp_rank: int) -> TransformerLM:
    gangs = fake_tp_gangs(tp_size, tp_rank)

    model = create_sharded_qwen35_model(config, gangs)

    load_hf_checkpoint_shards(model, path, config, gangs, read_buffer_bytes=1000)

    return model


def _moe_config(tied: bool) -> Qwen35MoeConfig:
    config = tiny_qwen35_moe_config()

    config.tied_embeddings = tied

    return config


def _with_mtp(config: Qwen35Config) -> Qwen35Config:
    config.mtp_num_layers = 1

    return config


def _untied_config() -> Qwen35Config:
    config = tiny_qwen35_config()

    config.tied_embeddings = False

    return config


class TestLoadHfCheckpointShards:
    @pytest.mark.parametrize(
        ("config", "layout"),
        [
            (tiny_qwen35_config(), "text"),
            (tiny_qwen35_config(), "vlm"),
            (_untied_config(), "text"),
            (_moe_config(tied=False), "fused"),
            (_moe_config(tied=True), "per_expert"),
            (_moe_config(tied=False), "qwen3_next"),
            (_with_mtp(tiny_qwen35_config()), "text"),
            (_with_mtp(_untied_config()), "nested_mtp"),
            (_with_mtp(_moe_config(tied=False)), "fused"),
            (_with_mtp(_moe_config(tied=True)), "per_expert"),
        ],
        ids=["dense-tied", "dense-vlm", "dense-untied", "moe-fused", "moe-per-expert-tied", "qwen3-next", "dense-mtp", "dense-nested-mtp", "moe-fused-mtp", "moe-per-expert-mtp"],
    )
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize(("tp_size", "tp_rank"), [(1, 0), (2, 1)], ids=["tp1", "tp2-rank1"])
    def test_gives_each_rank_its_part_of_the_converted_state_dict(
        self, config: Qwen35Config, layout: str, dtype: torch.dtype, tp_size: int, tp_rank: int, tmp_path: Path
    ) -> None:
        hg = _hf_state_dict(config, layout)

        _save(hg, tmp_path, dtype)

        hg = {k: v.to(dtype).float() for k, v in hg.items()}

        if isinstance(config, Qwen35MoeConfig):
            expected = convert_qwen35_moe_state_dict(dict(hg), config)
        else:
            expected = convert_qwen35_state_dict(dict(hg), config)

        model = _load(config, tmp_path, tp_size, tp_rank)

        shard_dims = get_shard_dims(model)

        names = [name for name, _ in model.named_parameters()]

        assert names, "The model must have parameters."

        assert any(name.startswith("mtp.") for name in names) == (config.mtp_num_layers > 0)

        for name, param in model.named_parameters():
            value = expected[name]

            assert isinstance(value, Tensor)

            assert torch.equal(param, _expected_shard(value, name, shard_dims, tp_size, tp_rank)), name

    def test_reads_only_the_headers_to_index(self, tmp_path: Path) -> None:
        _save({"a": torch.zeros(3, 4), "b": torch.ones(5)}, tmp_path, torch.bfloat16)

        index = index_safetensors(tmp_path)

        assert {k: (v.shape, v.dtype, v.num_rows, v.num_cols) for k, v in index.items()} == {
            "a": ((3, 4), torch.bfloat16, 3, 4),
            "b": ((5,), torch.bfloat16, 5, 1),
        }

    def test_raises_error_naming_a_truncated_file(self, tmp_path: Path) -> None:
        _save({"a": torch.zeros(3, 4), "b": torch.ones(5)}, tmp_path, torch.float32)

        file = next(tmp_path.glob("*.safetensors"))

        file.write_bytes(file.read_bytes()[:-4])

        with pytest.raises(CorruptModelCheckpointError, match=re.escape(f"{file} cannot be loaded as a safetensors checkpoint file")):
            index_safetensors(tmp_path)

    def test_raises_error_naming_a_tensor_of_the_wrong_shape(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        hg = _hf_state_dict(config, "text")

        hg["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)

        _save(hg, tmp_path, torch.float32)

        with pytest.raises(CorruptModelCheckpointError, match=re.escape("`decoder.layers.0.ffn.inner_proj.weight` must have a shape of (128, 64) in the model, but its checkpoint tensors (model.layers.0.mlp.up_proj.weight) make up 100 rows of 64 columns.")):
            _load(config, tmp_path, 1, 0)

    def test_raises_the_converter_error_for_unknown_keys(self, tmp_path: Path) -> None:
        config = tiny_qwen35_config()

        hg = _hf_state_dict(config, "text")

        hg["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(2, 2)

        _save(hg, tmp_path, torch.float32)

        with pytest.raises(StateDictError, match=r"not part of a Qwen3\.5 language model: model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight"):
            _load(config, tmp_path, 1, 0)

    @pytest.mark.parametrize(
        ("config", "layout"),
        [(tiny_qwen35_config(), "text"), (tiny_qwen35_config(), "vlm"), (_moe_config(tied=True), "fused")],
        ids=["dense-text", "dense-vlm", "moe"],
    )
    @pytest.mark.parametrize("differing_row", [0, -1], ids=["first-row", "last-row"])
    def test_raises_error_and_writes_nothing_when_a_tied_config_meets_a_trained_head(
        self, config: Qwen35Config, layout: str, differing_row: int, tmp_path: Path
    ) -> None:
        hg = _hf_state_dict(config, layout)

        embed_key = "model.language_model.embed_tokens.weight" if layout == "vlm" else "model.embed_tokens.weight"

        # A head that differs from the embedding in one entry of one row; the
        # small read buffer makes the comparison take many blocks.
        head = hg[embed_key].clone()

        head[differing_row, 3] += 1.0

        hg["lm_head.weight"] = head

        _save(hg, tmp_path, torch.float32)

        gangs = fake_tp_gangs(1, 0)

        model = create_sharded_qwen35_model(config, gangs)

        with torch.no_grad():
            for param in model.parameters():
                param.fill_(torch.nan)

        message = f"`lm_head.weight` must equal `{embed_key}` for a model with tied embeddings (`tied_embeddings: true`), but differs from it instead."

        with pytest.raises(StateDictError, match=re.escape(message) + ".*set `tied_embeddings: false`"):
            load_hf_checkpoint_shards(model, tmp_path, config, gangs, read_buffer_bytes=1000)

        assert all(param.isnan().all() for param in model.parameters())

    def test_raises_error_for_a_native_checkpoint(self, tmp_path: Path) -> None:
        save_file({"decoder_frontend.embed.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))

        with pytest.raises(StateDictError, match="must be a Hugging Face Qwen3.5 checkpoint"):
            _load(tiny_qwen35_config(), tmp_path, 1, 0)
