"""Qwen3.5-MoE models loaded through fairseq2 equal transformers 5.24's
``Qwen3_5MoeForCausalLM`` (run from the isolated overlay), and Qwen3-Next
models equal transformers 4.57's ``Qwen3NextForCausalLM`` (this
environment's pin): logits, the load-balancing loss, and bad checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from fairseq2.data.tokenizers import VocabularyInfo
from fairseq2.generation.sampling import SamplingSequenceGenerator, TopKSampler
from fairseq2.nn import BatchLayout

from hf_reference import HfReferenceBatch, TinyQwen35Spec, ensure_hf_reference, hf_greedy_generate
from hf_reference.fixtures import TinyModelCache
from hf_reference.tensors import random_padded_batch
from qwen35_fs2 import Qwen35MoeConfig, load_hf_model, qwen35_config_from_hf
from qwen35_fs2.nn import Qwen35MoeBlock, collect_moe_statistics
from qwen35_fs2.nn.moe.router import TopKRouter

pytestmark = pytest.mark.slow

_SEQ_LENS = [1, 63, 64, 65, 200]


# Small weights (initializer_range 0.02, as released models): with larger ones
# the Gated DeltaNets amplify fp32 rounding until our fp32 logits and the
# (equally fp32) reference both drift ~2e-5 from an fp64 run of the same model,
# so 2e-5 would test rounding rather than the model.
# Both expert layouts and checkpoint layouts; top-1 to top-4 of 4 to 12
# experts; tied and untied; GQA 2:1 to 6:1; value heads 1x to 3x the key heads.
_SPECS = {
    "fused-vlm-mtp-top2of8": TinyQwen35Spec(layout="vlm", moe=True, add_mtp=True, seed=11, initializer_range=0.02),
    "per-expert-text-top4of12-tied": TinyQwen35Spec(
        layout="text",
        moe=True,
        expert_layout="per_expert",
        tie_word_embeddings=True,
        num_experts=12,
        num_experts_per_tok=4,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=3,
        seed=12,
        initializer_range=0.02,
    ),
    "per-expert-vlm-top1of4-mixed-layers": TinyQwen35Spec(
        layout="vlm",
        moe=True,
        expert_layout="per_expert",
        num_hidden_layers=5,
        layer_types=("full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"),
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        seed=13,
        initializer_range=0.02,
    ),
    "fused-text-top3of6": TinyQwen35Spec(
        layout="text",
        moe=True,
        num_experts=6,
        num_experts_per_tok=3,
        partial_rotary_factor=0.5,
        rope_theta=10_000.0,
        seed=14,
        initializer_range=0.02,
    ),
}


@pytest.fixture(scope="module")
def reference(hf_tiny_models: TinyModelCache) -> dict[str, tuple[Path, Tensor]]:
    """Every spec's checkpoint and HF logits, from one reference subprocess."""
    model_dirs = hf_tiny_models.get_many(list(_SPECS.values()))

    batch = HfReferenceBatch()

    pending = {}

    for name, model_dir in zip(_SPECS, model_dirs):
        seqs, mask = random_padded_batch(_SPECS[name].vocab_size, _SEQ_LENS)

        pending[name] = (model_dir, batch.logits(model_dir, seqs, attention_mask=mask))

    batch.run()

    return {name: (model_dir, logits.result()) for name, (model_dir, logits) in pending.items()}


@pytest.mark.parametrize("name", list(_SPECS))
def test_logits_match_transformers(name: str, reference: dict[str, tuple[Path, Tensor]]) -> None:
    model_dir, expected = reference[name]

    seq_lens = _SEQ_LENS

    seqs, _ = random_padded_batch(_SPECS[name].vocab_size, seq_lens)

    model = load_hf_model(model_dir, dtype=torch.float32).eval()

    assert isinstance(model.decoder.layers[0].ffn, Qwen35MoeBlock)

    with torch.no_grad():
        logits = model(seqs, BatchLayout(seqs.shape, seq_lens))

    for idx, n in enumerate(seq_lens):
        diff = (logits[idx, :n] - expected[idx, :n]).abs().max().item()

        assert diff <= 2e-5, f"seq_len={n}: max abs diff {diff:.3g} > 2e-5"


def _run_hf_aux_loss(model_dir: Path, seqs: Tensor, mask: Tensor, router_logits: list[Tensor], tmp_path: Path) -> dict[str, float]:
    save_file({f"layer_{idx}": t.contiguous() for idx, t in enumerate(router_logits)}, tmp_path / "router_logits.safetensors")

    request = tmp_path / "request.json"

    request.write_text(
        json.dumps(
            {
                "model_dir": str(model_dir),
                "input_ids": seqs.tolist(),
                "attention_mask": mask.tolist(),
                "router_logits": str(tmp_path / "router_logits.safetensors"),
            }
        )
    )

    env = dict(os.environ, PYTHONPATH=str(ensure_hf_reference()), HF_HUB_OFFLINE="1")

    worker = Path(__file__).with_name("_hf_moe_worker.py")

    process = subprocess.run([sys.executable, "-P", str(worker), str(request)], env=env, capture_output=True, text=True)

    assert process.returncode == 0, process.stderr[-5000:]

    result: dict[str, float] = json.loads((tmp_path / "result.json").read_text())

    return result


@pytest.mark.parametrize("name", ["fused-vlm-mtp-top2of8", "per-expert-text-top4of12-tied"])
def test_load_balancing_loss_matches_transformers(name: str, hf_tiny_models: TinyModelCache, tmp_path: Path) -> None:
    spec = _SPECS[name]

    model_dir = hf_tiny_models.get(spec)

    seq_lens = [17, 40, 5]

    seqs, mask = random_padded_batch(spec.vocab_size, seq_lens)

    model = load_hf_model(model_dir, dtype=torch.float32).train()

    # Our router logits, for transformers' function.
    router_logits: list[Tensor] = []

    def capture(router: TopKRouter, args: tuple[Tensor]) -> None:
        router_logits.append(args[0].detach().float() @ router.weight.detach().float().t())

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_pre_hook(capture)

    model(seqs, BatchLayout(seqs.shape, seq_lens))

    statistics = collect_moe_statistics(model)

    assert statistics is not None

    ours = statistics.load_balancing_loss.item()

    expected = _run_hf_aux_loss(model_dir, seqs, mask, router_logits, tmp_path)

    # The same logits, and the model's own (which differ by float noise).
    assert abs(ours - expected["function_aux_loss"]) <= 1e-6
    assert abs(ours - expected["model_aux_loss"]) <= 1e-6

    assert statistics.num_tokens.item() == sum(seq_lens)


# Qwen3-Next: its own GDN layout, per-expert experts, optional dense layers
# and unnormalised routing. transformers' fp32 chunked delta rule differs
# from exact arithmetic by a few 1e-6, so weights stay moderate.
_QWEN3_NEXT_CONFIGS: dict[str, tuple[int, dict[str, object]]] = {
    "dense-layer-unnormalized": (21, dict(mlp_only_layers=[1], norm_topk_prob=False, num_experts=8, num_experts_per_tok=2)),
    "sparse-step-2-normalized": (22, dict(decoder_sparse_step=2, norm_topk_prob=True, num_experts=6, num_experts_per_tok=3)),
    "all-moe-v1x": (23, dict(norm_topk_prob=True, num_experts=4, num_experts_per_tok=1, linear_num_value_heads=2)),
}


def _make_qwen3_next(out_dir: Path, seed: int, **overrides: object) -> Qwen3NextForCausalLM:

    kwargs: dict[str, object] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        initializer_range=0.05,
    )

    kwargs.update(overrides)

    torch.manual_seed(seed)

    model = Qwen3NextForCausalLM(Qwen3NextConfig(**kwargs))  # type: ignore[no-untyped-call]

    model.eval()  # type: ignore[no-untyped-call]

    # HF initializes norms to constants; random ones expose a wrong `1 + w`.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))

    model.save_pretrained(out_dir)

    return model


@pytest.mark.parametrize("name", list(_QWEN3_NEXT_CONFIGS))
def test_qwen3_next_matches_transformers(name: str, tmp_path: Path) -> None:
    seed, overrides = _QWEN3_NEXT_CONFIGS[name]

    hf_model = _make_qwen3_next(tmp_path, seed, **overrides)

    seq_lens = [90, 33, 1]

    seqs, mask = random_padded_batch(256, seq_lens)

    with torch.no_grad():
        expected = hf_model(input_ids=seqs, attention_mask=mask, output_router_logits=True)

    model = load_hf_model(tmp_path, dtype=torch.float32).eval()

    with torch.no_grad():
        logits = model(seqs, BatchLayout(seqs.shape, seq_lens))

    for idx, n in enumerate(seq_lens):
        diff = (logits[idx, :n] - expected.logits[idx, :n]).abs().max().item()

        assert diff <= 2e-5, f"seq_len={n}: max abs diff {diff:.3g} > 2e-5"

    statistics = collect_moe_statistics(model)

    assert statistics is not None

    assert abs(statistics.load_balancing_loss.item() - expected.aux_loss.item()) <= 1e-6


class TestBadMoeCheckpoints:
    @pytest.fixture(params=["fused", "per_expert"])
    def checkpoint(self, request: pytest.FixtureRequest, hf_tiny_models: TinyModelCache, tmp_path: Path) -> Path:
        name = "fused-text-top3of6" if request.param == "fused" else "per-expert-text-top4of12-tied"

        source = hf_tiny_models.get(_SPECS[name])

        target = tmp_path / "ckpt"

        target.mkdir()

        for file in source.iterdir():
            (target / file.name).write_bytes(file.read_bytes())

        return target

    @staticmethod
    def _edit_tensors(checkpoint: Path, edit: object) -> None:
        file = checkpoint / "model.safetensors"

        tensors = load_file(file)

        edit(tensors)  # type: ignore[operator]

        save_file(tensors, file, metadata={"format": "pt"})

    @staticmethod
    def _is_fused(checkpoint: Path) -> bool:
        return "model.layers.0.mlp.experts.gate_up_proj" in load_file(checkpoint / "model.safetensors")

    def test_missing_expert_tensor_is_named(self, checkpoint: Path) -> None:
        if self._is_fused(checkpoint):
            self._edit_tensors(checkpoint, lambda t: t.pop("model.layers.2.mlp.experts.down_proj"))

            match = r"missing in the checkpoint: decoder\.layers\.2\.ffn\.experts\.output_proj"
        else:
            self._edit_tensors(checkpoint, lambda t: t.pop("model.layers.2.mlp.experts.7.up_proj.weight"))

            match = r"misses expert tensors of layer 2: model\.layers\.2\.mlp\.experts\.7\.up_proj\.weight"

        with pytest.raises(Exception, match=match):
            load_hf_model(checkpoint)

    def test_mis_shaped_expert_tensor_is_named(self, checkpoint: Path) -> None:
        if self._is_fused(checkpoint):
            key = "model.layers.1.mlp.experts.gate_up_proj"

            def edit(tensors: dict[str, Tensor]) -> None:
                tensors[key] = tensors[key][:, :-2].clone()

            match = r"`model\.layers\.1\.mlp\.experts\.gate_up_proj` must have a shape of \(6, 64, 64\) for the model's configuration, but has a shape of \(6, 62, 64\) instead\."
        else:
            key = "model.layers.1.mlp.experts.3.down_proj.weight"

            def edit(tensors: dict[str, Tensor]) -> None:
                tensors[key] = tensors[key].t().contiguous()

            match = r"`model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight` must have a shape of \(64, 24\) for the model's configuration, but has a shape of \(24, 64\) instead\."

        self._edit_tensors(checkpoint, edit)

        with pytest.raises(Exception, match=match):
            load_hf_model(checkpoint)

    def test_top_k_above_the_number_of_experts_is_named(self, checkpoint: Path) -> None:
        config_file = checkpoint / "config.json"

        hg_config = json.loads(config_file.read_text())

        hg_config["num_experts_per_tok"] = hg_config["num_experts"] + 1

        config_file.write_text(json.dumps(hg_config))

        with pytest.raises(Exception, match=r"`experts\.top_k` must be between 1 and `experts\.num_experts`"):
            load_hf_model(checkpoint)

    def test_the_unedited_checkpoint_loads(self, checkpoint: Path) -> None:
        hg_config = json.loads((checkpoint / "config.json").read_text())

        assert isinstance(qwen35_config_from_hf(hg_config), Qwen35MoeConfig)

        model = load_hf_model(checkpoint)

        assert all(isinstance(layer.ffn, Qwen35MoeBlock) for layer in model.decoder.layers)


def test_greedy_generation_matches_transformers(hf_tiny_models: TinyModelCache) -> None:
    """fairseq2's generator, prefilling in chunks and decoding step by step,
    against transformers' `generate` with its own cache."""
    # Larger weights than the logits specs: a random model with 0.02 weights
    # has nearly flat logits, where fp32 rounding decides near ties of the
    # greedy argmax.
    model_dir = hf_tiny_models.get(TinyQwen35Spec(layout="vlm", moe=True, add_mtp=True, seed=11))

    generator = torch.Generator().manual_seed(5)

    prompts = [torch.randint(1, 256, (n,), generator=generator) for n in (7, 12)]

    max_new_tokens = 24

    expected = hf_greedy_generate(model_dir, [p.tolist() for p in prompts], max_new_tokens)

    model = load_hf_model(model_dir, dtype=torch.float32).eval()

    # Token 0 stands in for EOS; at the length limit the generator ends with
    # it in place of the last token.
    vocab_info = VocabularyInfo(size=256, unk_idx=None, bos_idx=None, eos_idx=0, pad_idx=None)

    sampler = SamplingSequenceGenerator(
        model, vocab_info, TopKSampler(k=1), max_gen_len=max_new_tokens, prefill_chunk_size=3
    )

    seqs = torch.zeros((2, 12), dtype=torch.int64)

    for idx, prompt in enumerate(prompts):
        seqs[idx, : prompt.numel()] = prompt

    output = sampler(seqs, BatchLayout(seqs.shape, [p.numel() for p in prompts]))

    num_compared = 0

    for hypotheses, tokens in zip(output.hypotheses, expected):
        generated = hypotheses[0].seq.tolist()

        assert generated[-1] == 0

        # Up to the length limit, or up to a 0 that transformers generated too.
        assert generated[:-1] == tokens[: len(generated) - 1]

        assert len(generated) == max_new_tokens or tokens[len(generated) - 1] == 0

        num_compared += len(generated)

    assert num_compared >= max_new_tokens
