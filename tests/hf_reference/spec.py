"""Describes the tiny random Qwen3.5 checkpoints that the HF reference builds."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

CheckpointLayout = Literal["vlm", "text"]

ExpertLayout = Literal["fused", "per_expert"]

ReferenceDtype = Literal["float32", "bfloat16"]

ReferencePrecision = Literal["float32", "bfloat16", "autocast_bfloat16"]
"""
How the reference runs a forward pass: ``"float32"`` or ``"bfloat16"`` loads the
model in that dtype (``from_pretrained(dtype=...)``, weights and activations);
``"autocast_bfloat16"`` loads it in fp32 and runs under
``torch.autocast("cpu", torch.bfloat16)``, as single-device mixed-precision
training does.
"""

LayerTypeName = Literal["linear_attention", "full_attention"]


@dataclass(frozen=True, kw_only=True)
class TinyQwen35Spec:
    """Describes a tiny random Qwen3.5 checkpoint; fields use HF config names.

    Frozen, so that a spec can key a cache of built checkpoints.
    """

    layout: CheckpointLayout = "text"
    """
    ``"vlm"``: ``Qwen3_5(Moe)ForConditionalGeneration`` with a tiny vision tower,
    keys ``model.language_model.*``, ``model.visual.*``, ``lm_head.*``, as in the
    released checkpoints. ``"text"``: ``Qwen3_5(Moe)ForCausalLM``, keys
    ``model.*``, ``lm_head.*``.
    """

    moe: bool = False
    """If ``True``, builds ``Qwen3_5Moe*`` (every layer MoE) instead of dense."""

    hidden_size: int = 64
    """The model width ``H``."""

    num_hidden_layers: int = 4
    """The number of decoder layers."""

    layer_types: tuple[LayerTypeName, ...] | None = None
    """The mixer of every layer. If ``None``, derived from ``full_attention_interval``."""

    full_attention_interval: int = 4
    """Layer ``i`` is full attention iff ``(i + 1) % interval == 0``, as in HF."""

    num_attention_heads: int = 4
    """The query heads of full-attention layers."""

    num_key_value_heads: int = 2
    """The key/value heads of full-attention layers (GQA)."""

    head_dim: int = 32
    """The head width of full-attention layers."""

    linear_num_key_heads: int = 2
    """The query/key heads of Gated DeltaNet layers."""

    linear_num_value_heads: int = 4
    """The value heads of Gated DeltaNet layers, a multiple of the key heads."""

    linear_key_head_dim: int = 16
    """The query/key head width of Gated DeltaNet layers."""

    linear_value_head_dim: int = 16
    """The value head width of Gated DeltaNet layers."""

    linear_conv_kernel_dim: int = 4
    """The kernel size of the Gated DeltaNet causal convolution."""

    intermediate_size: int = 96
    """The dense MLP width (ignored when ``moe``)."""

    num_experts: int = 8
    """The routed experts per MoE layer."""

    num_experts_per_tok: int = 2
    """The experts each token is routed to (top-k)."""

    moe_intermediate_size: int = 32
    """The width of each routed expert."""

    shared_expert_intermediate_size: int = 48
    """The width of the shared expert."""

    vocab_size: int = 256
    """The size of the embedding table."""

    tie_word_embeddings: bool = False
    """If ``True``, ``lm_head`` shares the embedding table and is not saved."""

    rope_theta: float = 10_000_000.0
    """The RoPE base, as released."""

    partial_rotary_factor: float = 0.25
    """The fraction of each attention head that RoPE rotates, as released."""

    rms_norm_eps: float = 1e-6
    """The epsilon of every RMSNorm."""

    initializer_range: float = 0.1
    """
    The std of HF's normal initialisation. Larger than HF's 0.02 so that, at
    these widths, every block moves the logits visibly and MoE routing has
    clear margins between experts.
    """

    dtype: ReferenceDtype = "float32"
    """The dtype of the saved tensors."""

    seed: int = 0
    """
    Seeds the language model's weights; specs that differ only in ``layout``,
    ``dtype`` (a cast), ``expert_layout`` or ``add_mtp`` hold the same language
    model.
    """

    add_mtp: bool = False
    """
    If ``True``, adds the top-level ``mtp.*`` multi-token-prediction tensors that
    released checkpoints carry but HF's ``save_pretrained`` does not write.
    """

    expert_layout: ExpertLayout = "fused"
    """
    ``"fused"``: ``mlp.experts.gate_up_proj [E, 2I, H]`` and
    ``mlp.experts.down_proj [E, H, I]``, as in the released checkpoints.
    ``"per_expert"``: ``mlp.experts.{e}.{gate,up,down}_proj.weight``, as
    transformers 5.24's ``save_pretrained`` writes.
    """

    def __post_init__(self) -> None:
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"`layer_types` must have `num_hidden_layers` ({self.num_hidden_layers}) entries, "
                f"but has {len(self.layer_types)} instead."
            )

        if self.linear_num_value_heads % self.linear_num_key_heads != 0:
            raise ValueError(
                f"`linear_num_value_heads` must be a multiple of `linear_num_key_heads` "
                f"({self.linear_num_key_heads}), but is {self.linear_num_value_heads} instead."
            )

        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads}), but is {self.num_attention_heads} instead."
            )

        if self.moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"`num_experts_per_tok` must be between 1 and `num_experts` ({self.num_experts}), "
                f"but is {self.num_experts_per_tok} instead."
            )

    def resolved_layer_types(self) -> tuple[LayerTypeName, ...]:
        """Returns the mixer of every layer, as HF derives it."""
        if self.layer_types is not None:
            return self.layer_types

        return tuple(
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def qwen35_0p8b_spec(*, num_hidden_layers: int, **fields: Any) -> TinyQwen35Spec:
    """Returns the spec of a random checkpoint of Qwen3.5-0.8B's text
    configuration (the widths and head counts of ``Qwen/Qwen3.5-0.8B``'s
    config.json, tied embeddings, initializer range 0.02) with
    ``num_hidden_layers`` of its 24 layers; ``fields`` override the rest
    (the layout, the vocabulary size, the dtype, the seed)."""
    real: dict[str, Any] = {
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "intermediate_size": 3584,
        "vocab_size": 248_320,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
    }

    return TinyQwen35Spec(**{**real, **fields, "num_hidden_layers": num_hidden_layers})
