"""The configuration of LoRA fine-tuning."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from fairseq2.utils.validation import ValidationResult

# The projections an adapter can be put on, by their Hugging Face module
# names, as PEFT's `target_modules` names them. `gate_proj`, `up_proj` and
# `down_proj` name the MLP of dense layers and the shared expert of MoE
# layers, as they do in PEFT on a transformers model.
LORA_TARGET_MODULES: Final = (
    "q_proj", "k_proj", "v_proj", "o_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip

# The stacked weights of the routed experts that an adapter can be put on,
# as PEFT's `target_parameters` names them: transformers stores the experts
# as fused 3-D parameters, not modules.
LORA_TARGET_PARAMETERS: Final = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

# Names of the routed experts that `target_modules` cannot select.
_ROUTED_EXPERT_NAMES: Final = ("experts", "gate_up_proj")


@dataclass(kw_only=True)
class LoraConfig:
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    """
    The projections that get an adapter, by their Hugging Face module names
    (PEFT's ``target_modules``): any of ``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj`` (gated attention), ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, ``out_proj`` (Gated DeltaNet),
    ``gate_proj``, ``up_proj``, ``down_proj`` (the MLP, and the shared
    expert of MoE layers). The default is all of them.
    """

    target_parameters: list[str] = field(default_factory=list)
    """
    The stacked weights of the routed experts (MoE models) that get one
    adapter per expert, by their Hugging Face parameter names (PEFT's
    ``target_parameters``): ``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``, or both. Needs ``dropout_p`` 0, as in PEFT,
    and a tensor parallel size of 1. The default is none.
    """

    r: int = 16
    """The rank of the adapters."""

    alpha: float = 32.0
    """The numerator of the adapters' scaling (PEFT's ``lora_alpha``)."""

    dropout_p: float = 0.0
    """The dropout probability on the adapters' input (PEFT's ``lora_dropout``)."""

    rslora: bool = False
    """
    If ``True``, scales the adapters by ``alpha / sqrt(r)`` (rank-stabilised
    LoRA, PEFT's ``use_rslora``) instead of ``alpha / r``.
    """

    def validate(self) -> ValidationResult:
        result = ValidationResult()

        if self.r <= 0:
            result.add_error(f"`r` must be greater than 0, but is {self.r} instead.")

        if not 0.0 <= self.dropout_p < 1.0:
            result.add_error(f"`dropout_p` must be in [0, 1), but is {self.dropout_p} instead.")

        if not self.target_modules:
            result.add_error("`target_modules` must name at least one projection, but is empty.")

        for name in self.target_modules:
            if name in _ROUTED_EXPERT_NAMES:
                result.add_error(
                    f"`target_modules` must not name the routed experts (`{name}`), which are no modules in transformers. "
                    f"Name their stacked weights in `target_parameters` instead ({', '.join(LORA_TARGET_PARAMETERS)})."
                )
            elif name not in LORA_TARGET_MODULES:
                result.add_error(
                    f"`target_modules` must hold Hugging Face projection names ({', '.join(LORA_TARGET_MODULES)}), but holds `{name}` instead."
                )

        if len(set(self.target_modules)) != len(self.target_modules):
            result.add_error(f"`target_modules` must not repeat a name, but is {self.target_modules} instead.")

        for name in self.target_parameters:
            if name not in LORA_TARGET_PARAMETERS:
                result.add_error(
                    f"`target_parameters` must hold Hugging Face names of routed expert weights ({', '.join(LORA_TARGET_PARAMETERS)}), but holds `{name}` instead."
                )

        if len(set(self.target_parameters)) != len(self.target_parameters):
            result.add_error(f"`target_parameters` must not repeat a name, but is {self.target_parameters} instead.")

        if self.target_parameters and self.dropout_p != 0.0:
            result.add_error(
                f"`dropout_p` must be 0 when `target_parameters` is set, but is {self.dropout_p} instead: "
                "the adapters of routed experts update their weights, which has no input to drop, as in PEFT."
            )

        return result


def validate_lora_tensor_parallelism(lora: LoraConfig | None, tensor_parallel_size: int) -> ValidationResult:
    """Checks a recipe's ``lora`` section against its tensor parallel size.

    A column-sharded adapter's ``A`` sees the input all tensor-parallel ranks
    share, and its dropout mask would have to be the same on all of them.
    fairseq2's trainer seeds each rank apart (its seed plus the rank): the
    ranks' gradients of their copies of ``A`` would differ, and the copies
    with them.
    """
    result = ValidationResult()

    if lora is not None and lora.dropout_p > 0.0 and tensor_parallel_size > 1:
        result.add_error(
            f"`lora.dropout_p` must be 0 under tensor parallelism (`gang.tensor_parallel_size` {tensor_parallel_size}), since the ranks would drop different entries of the input they share, but is {lora.dropout_p} instead."
        )

    return result
