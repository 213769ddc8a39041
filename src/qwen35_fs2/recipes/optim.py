"""The AdamW configuration of the training recipes: which parameters get no
weight decay; and the check of the cosine schedule's length
(:func:`validate_cosine_schedule`).

Weight decay pulls a weight towards zero. That is a regulariser for the
projection matrices, but it changes what the other parameters mean:

- ``A_log`` and ``dt_bias`` of Gated DeltaNet set how fast each head forgets
  (the decay rate is ``exp(A_log) * softplus(x + dt_bias)``); pulling them to
  zero moves every head towards the same forgetting rate;
- norm weights are per-channel gains and biases per-channel offsets, not
  couplings between features;
- the depthwise convolution kernels of Gated DeltaNet hold a handful of taps
  per channel, not a projection;
- the input embedding: the rows of tokens that the data never contains get no
  gradient, so decay would only shrink them, step after step, and with tied
  embeddings (Qwen3.5 0.8B to 4B) also the logits of those tokens. An untied
  output projection (``final_proj``) is decayed like any projection: every row
  gets a gradient at every position.

The groups are fairseq2's (``AdamWConfig.groups``): regular expressions matched
with :func:`re.match` against the names of ``model.named_parameters()``, the
first matching group wins, the rest use the top-level settings. The patterns
match the last components of a name only, so that wrappers in front of them
(activation checkpointing's ``_checkpoint_wrapped_module.``, DDP's
``module.``) and submodules around ``A_log``/``dt_bias`` do not change the
outcome.
"""

from __future__ import annotations

from typing import Final

from fairseq2.recipe.config import (
    ADAMW_OPTIMIZER,
    AdamWConfig,
    AdamWGroupConfig,
    CosineAnnealingLRConfig,
    LRSchedulerSection,
    OptimizerSection,
    RegimeSection,
)
from fairseq2.utils.validation import ValidationResult

NO_WEIGHT_DECAY_PARAMS: Final = (
    # Gated DeltaNet's forgetting rates.
    r".*\.A_log$",
    r".*\.dt_bias$",
    # Layer norms (`*_layer_norm`, `decoder.layer_norm`) and the q/k norms of
    # full attention.
    r".*_norm\.weight$",
    # The gated norm of Gated DeltaNet (`linear_attn.norm`).
    r".*\.norm\.weight$",
    # The input norms of the MTP head.
    r".*\.pre_fc_norm_(embedding|hidden)\.weight$",
    r".*\.bias$",
    # The depthwise convolution of Gated DeltaNet.
    r".*\.conv1d\.weight$",
    # The input embedding (also the output projection when tied).
    r".*\.embed\.weight$",
)
"""The names of the parameters that the training recipes do not decay."""


def create_adamw_section(*, lr: float, weight_decay: float) -> OptimizerSection:
    """Returns AdamW with ``betas=(0.9, 0.95)`` that decays every parameter by
    ``weight_decay`` except those of :data:`NO_WEIGHT_DECAY_PARAMS`."""
    no_decay = AdamWGroupConfig(params=list(NO_WEIGHT_DECAY_PARAMS), weight_decay=0.0)

    config = AdamWConfig(
        lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, groups=[no_decay]
    )

    return OptimizerSection(name=ADAMW_OPTIMIZER, config=config)


def validate_cosine_schedule(lr_scheduler: LRSchedulerSection, regime: RegimeSection) -> ValidationResult:
    """Returns an error if the cosine schedule's cycle has no step.

    Without ``cycle_len`` fairseq2 makes the cycle ``regime.num_steps -
    num_warmup_steps`` steps long. A cycle of no steps divides by zero at the
    last step, which fairseq2 reports as an unexpected error at the end of
    the run; a run shorter than its warmup never reaches the cycle.
    """
    result = ValidationResult()

    config = lr_scheduler.config

    if not isinstance(config, CosineAnnealingLRConfig) or config.cycle_len is not None or regime.num_steps is None:
        return result

    if regime.num_steps == config.num_warmup_steps:
        result.add_error(
            f"`regime.num_steps` must differ from `lr_scheduler.config.num_warmup_steps` ({config.num_warmup_steps}), since the cosine cycle, the steps after the warmup, would have none, but is {regime.num_steps}."
        )

    return result
