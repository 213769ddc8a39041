"""The ``config.json`` of an export."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from qwen35_fs2.hf.config import get_text_config
from qwen35_fs2.hf.export.repository import EXPORT_DTYPES, HfRepository
from qwen35_fs2.models.qwen35.config import ENDOFTEXT_IDX, Qwen35Config
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig

def build_hf_config(
    config: Qwen35Config,
    *,
    base: HfRepository | None,
    text_only: bool,
    dtype: torch.dtype,
    num_mtp_layers: int,
) -> dict[str, object]:
    """Builds the ``config.json`` document of an export.

    Every key is set explicitly: those that describe the language model come
    from ``config``; the others (vision tower, special token ids, keys this
    package does not model) from ``base``, else the released values.
    """
    dtype_name = _dtype_name(dtype)

    if base is None:
        base_text: Mapping[str, object] = {}
    else:
        base_text = get_text_config(base.config)

    text = {**_released_text_defaults(config), **base_text}

    text.update(_text_entries(config))

    if isinstance(config, Qwen35MoeConfig):
        # transformers' MoE text config has no dense width.
        text.pop("intermediate_size", None)

    # transformers 5 nests RoPE in `rope_parameters`; older files use
    # `rope_scaling` and a top-level `rope_theta`.
    rope: dict[str, object] = {
        "mrope_section": _mrope_section(config.rotary_dim),
        "mrope_interleaved": True,
    }

    for key in ("rope_scaling", "rope_parameters"):
        base_rope = text.pop(key, None)

        if isinstance(base_rope, Mapping):
            rope.update(base_rope)

    rope.pop("type", None)

    rope.update(
        rope_type="default",
        rope_theta=config.rope_theta,
        partial_rotary_factor=config.partial_rotary_factor,
    )

    text["rope_parameters"] = rope

    if "rope_theta" in text:
        text["rope_theta"] = config.rope_theta

    text["mtp_num_hidden_layers"] = num_mtp_layers

    moe = isinstance(config, Qwen35MoeConfig)

    if text_only:
        text.pop("torch_dtype", None)

        return {
            **text,
            "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
            "model_type": text["model_type"],
            "dtype": dtype_name,
        }

    if base is None:
        raise ValueError("`base` must be given for the vision-language layout, but is None.")

    for key in ("dtype", "torch_dtype"):
        if key in text:
            text[key] = dtype_name

    doc = copy.deepcopy(base.config)

    doc.setdefault(
        "architectures",
        ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
    )

    doc["text_config"] = text
    doc["tie_word_embeddings"] = config.tied_embeddings
    doc["dtype"] = dtype_name

    if "torch_dtype" in doc:
        doc["torch_dtype"] = dtype_name

    return doc


def _text_entries(config: Qwen35Config) -> dict[str, object]:
    """The text-config keys that ``config`` determines."""
    layer_types = config.get_layer_types()

    entries: dict[str, object] = {
        "model_type": "qwen3_5_text",
        "vocab_size": config.vocab_size,
        "hidden_size": config.model_dim,
        "intermediate_size": config.ffn_inner_dim,
        "num_hidden_layers": config.num_layers,
        "layer_types": layer_types,
        "num_attention_heads": config.num_attn_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "attention_bias": False,
        "attn_output_gate": True,
        "linear_num_key_heads": config.num_linear_key_heads,
        "linear_num_value_heads": config.num_linear_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel_size,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.init_std,
        "partial_rotary_factor": config.partial_rotary_factor,
        "tie_word_embeddings": config.tied_embeddings,
        "pad_token_id": config.pad_idx,
    }

    if isinstance(config, Qwen35MoeConfig):
        entries.update(
            model_type="qwen3_5_moe_text",
            num_experts=config.experts.num_experts,
            num_experts_per_tok=config.experts.top_k,
            moe_intermediate_size=config.experts.inner_dim,
            shared_expert_intermediate_size=config.experts.shared_expert_inner_dim,
        )

    # Only where it describes `layer_types`; transformers prefers the list.
    interval = config.full_attention_interval

    if layer_types == [
        "full_attention" if (idx + 1) % interval == 0 else "linear_attention"
        for idx in range(config.num_layers)
    ]:
        entries["full_attention_interval"] = interval

    return entries


def _released_text_defaults(config: Qwen35Config) -> dict[str, object]:
    """The text-config keys of the released models that ``Qwen35Config`` does
    not model; a base's own values take precedence."""
    # The released text configs end text with <|endoftext|>.
    eos_idx = ENDOFTEXT_IDX if config.vocab_size > ENDOFTEXT_IDX else None

    defaults: dict[str, object] = {
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_idx,
        "use_cache": True,
        "mtp_use_dedicated_embeddings": False,
        "mamba_ssm_dtype": "float32",
    }

    if isinstance(config, Qwen35MoeConfig):
        defaults.update(router_aux_loss_coef=0.001, output_router_logits=False)

    return defaults


def _mrope_section(rotary_dim: int) -> list[int]:
    """Splits the rotary frequencies over (T, H, W) as the released [11, 11,
    10] splits 32; with text alone the three positions are equal and the split
    has no effect."""
    base, rest = divmod(rotary_dim // 2, 3)

    return [base + int(rest > 0), base + int(rest > 1), base]


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in EXPORT_DTYPES.items():
        if value == dtype:
            return name

    raise ValueError(
        f"`dtype` must be one of {', '.join(EXPORT_DTYPES)}, but is {dtype} instead."
    )
