"""Configuration of the Qwen3.5-MoE family (and Qwen3-Next, which it loads)
and its architecture presets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from fairseq2.runtime.config_registry import ConfigRegistrar
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.utils.validation import ValidationResult

from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.nn.moe.experts import ExpertDispatch
from qwen35_fs2.nn.moe.router import RouterPrecision

QWEN35_MOE_FAMILY: Final = "qwen35_moe"

QWEN3_NEXT_ENDOFTEXT_IDX: Final = 151_643
"""The index of ``<|endoftext|>``, the pad token of the Qwen3 vocabulary that
Qwen3-Next uses."""


@dataclass(kw_only=True)
class Qwen35ExpertsConfig:
    """Holds the configuration of the MoE blocks of a Qwen3.5-MoE model.

    The defaults describe Qwen3.5-35B-A3B.
    """

    num_experts: int = 256
    """The number of routed experts of each MoE block."""

    top_k: int = 8
    """The number of experts each token is routed to."""

    inner_dim: int = 512
    """The inner dimensionality of each routed expert (SwiGLU)."""

    shared_expert_inner_dim: int = 512
    """The inner dimensionality of the shared expert (SwiGLU)."""

    normalize_top_k: bool = True
    """
    If ``True``, the weights of a token's ``top_k`` experts are renormalised
    to sum to 1. Qwen3.5 always renormalises; Qwen3-Next configs choose
    (``norm_topk_prob``).
    """

    dense_layers: list[int] = field(default_factory=list)
    """
    The layers whose feed-forward network is a dense SwiGLU of
    ``ffn_inner_dim`` instead of an MoE block (Qwen3-Next's
    ``mlp_only_layers`` and ``decoder_sparse_step``). Empty in Qwen3.5.
    """

    dispatch: ExpertDispatch = "auto"
    """
    How experts run on their tokens: ``grouped_mm`` (Hopper GPUs, bf16),
    ``batched`` or ``loop`` (anywhere), or ``auto``; see
    :data:`~qwen35_fs2.nn.moe.experts.ExpertDispatch`.
    """

    router_precision: RouterPrecision = "activation"
    """
    Where the router computes its logits: ``activation`` (in the autocast or
    activation dtype, as transformers and vLLM do, so that training routes
    near-tied tokens as serving will) or ``fp32``; see
    :data:`~qwen35_fs2.nn.moe.router.RouterPrecision`. Hugging Face configs have
    no such setting; it is neither read from nor written to them.
    """


@dataclass(kw_only=True)
class Qwen35MoeConfig(Qwen35Config):
    """Holds the configuration of a Qwen3.5-MoE language model: the hybrid
    decoder of :class:`Qwen35Config` with MoE feed-forward blocks.

    The defaults describe Qwen3.5-35B-A3B. ``ffn_inner_dim`` is used only by
    ``experts.dense_layers``.
    """

    model_dim: int = 2048
    """The dimensionality of the model."""

    tied_embeddings: bool = False
    """If ``True``, ties the embedding table and the output projection."""

    num_layers: int = 40
    """The number of decoder layers."""

    num_attn_heads: int = 16
    """The number of query heads in full-attention layers."""

    num_key_value_heads: int = 2
    """The number of key/value heads in full-attention layers (GQA)."""

    num_linear_value_heads: int = 32
    """
    The number of value heads in Gated DeltaNet layers; a multiple of
    ``num_linear_key_heads``.
    """

    experts: Qwen35ExpertsConfig = field(default_factory=Qwen35ExpertsConfig)
    """The configuration of the MoE blocks."""

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Returns ``True`` if layer ``layer_idx`` has an MoE block."""
        return layer_idx not in self.experts.dense_layers

    def validate(self) -> ValidationResult:
        result = super().validate()

        experts = self.experts

        for name in ("num_experts", "inner_dim", "shared_expert_inner_dim"):
            value = getattr(experts, name)

            if value < 1:
                result.add_error(
                    f"`experts.{name}` must be greater than or equal to 1, but is {value} instead."
                )

        if not 1 <= experts.top_k <= max(experts.num_experts, 1):
            result.add_error(
                f"`experts.top_k` must be between 1 and `experts.num_experts` ({experts.num_experts}), but is {experts.top_k} instead."
            )

        for layer_idx in experts.dense_layers:
            if not 0 <= layer_idx < self.num_layers:
                result.add_error(
                    f"`experts.dense_layers` must hold layer indices in [0, {self.num_layers}), but holds {layer_idx}."
                )

        if experts.dispatch not in ("auto", "grouped_mm", "batched", "loop"):
            result.add_error(
                f"`experts.dispatch` must be 'auto', 'grouped_mm', 'batched', or 'loop', but is '{experts.dispatch}' instead."
            )

        if experts.router_precision not in ("activation", "fp32"):
            result.add_error(
                f"`experts.router_precision` must be 'activation' or 'fp32', but is '{experts.router_precision}' instead."
            )

        return result


def register_qwen35_moe_configs(container: DependencyContainer) -> None:
    arch = ConfigRegistrar(container, Qwen35MoeConfig)

    # Values of the released `config.json` files (secondary sources for
    # 122B-A10B and 397B-A17B; see the architecture notes, §1b).

    @arch("qwen35_moe_35b_a3b")
    def qwen35_moe_35b_a3b() -> Qwen35MoeConfig:
        return Qwen35MoeConfig()

    @arch("qwen35_moe_122b_a10b")
    def qwen35_moe_122b_a10b() -> Qwen35MoeConfig:
        config = Qwen35MoeConfig()

        config.model_dim = 3072
        config.num_layers = 48
        config.num_attn_heads = 32
        config.num_linear_value_heads = 64
        config.experts.inner_dim = 1024
        config.experts.shared_expert_inner_dim = 1024

        return config

    @arch("qwen35_moe_397b_a17b")
    def qwen35_moe_397b_a17b() -> Qwen35MoeConfig:
        config = Qwen35MoeConfig()

        config.model_dim = 4096
        config.num_layers = 60
        config.num_attn_heads = 32
        config.num_linear_value_heads = 64
        config.experts.num_experts = 512
        config.experts.top_k = 10
        config.experts.inner_dim = 1024
        config.experts.shared_expert_inner_dim = 1024

        return config

    @arch("qwen3_next_80b_a3b")
    def qwen3_next_80b_a3b() -> Qwen35MoeConfig:
        """Qwen3-Next-80B-A3B, whose checkpoints load into this family."""
        config = Qwen35MoeConfig()

        config.vocab_size = 151_936
        config.pad_idx = QWEN3_NEXT_ENDOFTEXT_IDX
        config.num_layers = 48
        config.ffn_inner_dim = 5120
        config.experts.num_experts = 512
        config.experts.top_k = 10

        return config

    @arch("qwen35_moe_tiny")
    def qwen35_moe_tiny() -> Qwen35MoeConfig:
        return tiny_qwen35_moe_config()


def tiny_qwen35_moe_config() -> Qwen35MoeConfig:
    """Returns a 4-layer, 64-dimensional Qwen3.5-MoE configuration with 8
    experts (top-2) for tests."""
    return Qwen35MoeConfig(
        model_dim=64,
        max_seq_len=2048,
        vocab_size=1024,
        pad_idx=0,
        tied_embeddings=False,
        num_layers=4,
        num_attn_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_linear_key_heads=2,
        num_linear_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        ffn_inner_dim=96,
        experts=Qwen35ExpertsConfig(
            num_experts=8, top_k=2, inner_dim=32, shared_expert_inner_dim=48
        ),
    )
