"""A language-model loss that never materialises the logits of a whole batch.

With Qwen3.5's 248,320-entry vocabulary, fairseq2's
:meth:`TransformerLM.compute_fused_loss` holds the logits and their fp32
log-probabilities for every token of the batch at once: 16k tokens take about
16 GB for the log-probabilities alone. Here the final projection and the cross
entropy run piece by piece, so that peak memory is the logits of
``chunk_size`` tokens instead of the batch's:

- when training with a summed or mean loss through a plain (tied or
  unsharded) projection, the loss is fused with the projection, in one of
  two ways:

  - where the gradients come out as exactly (fp32, a frozen projection as
    LoRA trains it without autocast, or all tokens in one chunk; never fp16;
    under ``torch.compile`` only a frozen projection, as an operator), the
    pieces are chunks of tokens, each with all classes, and the forward pass
    computes the gradients too: the logits once, three products of the
    projection's size (two for a frozen one). What it keeps for the
    backward pass is the gradients themselves, which the other way
    allocates as its backward pass starts;
  - otherwise the pieces are blocks of classes, each over all tokens. The
    forward pass keeps only each token's log-sum-exp; the backward pass
    recomputes each block's logits and forms their gradient in fp32,
    multiplied by the incoming gradient before it is rounded to the compute
    dtype, so that fp16 training gets its loss scale applied before small
    probabilities underflow. Nothing of the projection's size is held
    between the passes, and the weight's gradient is written in place,
    block by block, without an fp32 copy, at the cost of one more product
    of the projection's size (the logits twice); see
    ``docs/performance.md``. Under ``torch.compile`` this way runs as an
    operator, opaque to the graph, whose tracing would otherwise keep the
    forward pass's logits for the backward pass;
- otherwise the pieces are chunks of tokens, each checkpointed: its logits
  are freed after the forward pass and recomputed, one chunk at a time, in
  the backward pass.

The semantics are those of :func:`fairseq2.nn.functional.cross_entropy`
(``pad_idx``, ``target_mask``, ``reduction``, ``label_smoothing``), which each
checkpointed chunk calls. Targets equal to ``pad_idx`` never count; a model
that must learn to predict its pad token (pretraining, where the
end-of-document token ``<|endoftext|>`` is also Qwen3.5's pad token) must be
built with ``pad_idx=None``.
"""

from __future__ import annotations

import math
from functools import partial
from types import MethodType
from typing import Any, Final, Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from torch.nn import Module

from fairseq2.error import InternalError
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout, ColumnShardedLinear, Linear, Projection, TiedProjection
from fairseq2.nn.functional import cross_entropy

from qwen35_fs2.nn.mtp import (
    MtpLoss,
    Qwen35MultiTokenPredictor,
    mtp_target_mask,
    pass_batch_layout_to_mtp,
    shift_mtp_targets,
)
from qwen35_fs2.ops.autocast import autocast_dtype, autocast_free
from qwen35_fs2.ops.operator_outputs import empty_output, output_grad

MtpLossMode: TypeAlias = Literal["off", "eval", "train"]
"""When the loss of a model's MTP head is computed: never, in evaluation
mode only, or always."""

DEFAULT_LOSS_CHUNK_SIZE: Final = 1024
"""
The default number of tokens whose logits are computed at once: their fp32
logits take ``chunk_size * vocab_size * 4`` bytes (1 GiB with Qwen3.5's
vocabulary). The fused path that computes its gradients in the backward pass
computes as many logits at once, as a block of ``chunk_size * vocab_size /
num_tokens`` classes for all tokens.
"""


def chunked_cross_entropy(
    decoder_output: Tensor,
    final_proj: Projection,
    targets: Tensor,
    pad_idx: int | None,
    *,
    label_smoothing: float = 0.0,
    target_mask: Tensor | None = None,
    reduction: Literal["sum", "mean", "none"] = "sum",
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
) -> Tensor:
    """Computes ``cross_entropy(final_proj(decoder_output), targets, ...)``
    with the logits of at most ``chunk_size`` tokens at once (see the module
    docstring).

    :param decoder_output: *Shape:* :math:`(N,S,M)`, or :math:`(S,M)` if
        packed.
    :param targets: *Shape:* :math:`(N,S)`, or :math:`(S)` if packed.
    :param target_mask: A boolean mask of the targets that count. *Shape:*
        Same as ``targets``.
    """
    if chunk_size < 1:
        raise ValueError(
            f"`chunk_size` must be greater than or equal to 1, but is {chunk_size} instead."
        )

    if decoder_output.shape[:-1] != targets.shape:
        raise ValueError(
            f"`decoder_output` must be of shape {(*targets.shape, '*')} to match `targets`, but is of shape {tuple(decoder_output.shape)} instead."
        )

    if target_mask is not None:
        if target_mask.dtype != torch.bool:
            raise TypeError(
                f"`target_mask` must be a boolean tensor, but is of type `{target_mask.dtype}` instead."
            )

        if target_mask.shape != targets.shape:
            raise ValueError(
                f"`target_mask` must be of shape {tuple(targets.shape)} to match `targets`, but is of shape {tuple(target_mask.shape)} instead."
            )

    if reduction not in ("sum", "mean", "none"):
        raise ValueError(
            f"`reduction` must be 'sum', 'mean' or 'none', but is '{reduction}' instead."
        )

    # (N, S, M) -> (N x S, M)
    flat_output = decoder_output.flatten(0, -2)

    flat_targets = targets.flatten()

    flat_mask = None if target_mask is None else target_mask.flatten()

    # Without gradients, the chunks below are cheaper (nothing to keep for a
    # backward pass); but under `torch.compile` their loop over the tokens
    # specializes the graph on the token count, which the fused operator's
    # loops, inside it, do not (see `_fused_linear_cross_entropy`).
    if reduction != "none" and (torch.is_grad_enabled() or torch.compiler.is_compiling()):
        proj_params = _get_plain_projection_params(final_proj)

        if proj_params is not None:
            weight, bias = proj_params

            target_weights = _get_target_weights(flat_targets, pad_idx, flat_mask)

            if reduction == "mean":
                # As in `cross_entropy`, the mean of no target is NaN (0 / 0).
                target_weights = target_weights / target_weights.sum()

            # Under autocast, the projection runs in the autocast dtype.
            compute_dtype = autocast_dtype(flat_output)

            loss: Tensor

            if _gradients_in_forward(flat_targets.size(0), chunk_size, weight, bias, compute_dtype):
                if torch.compiler.is_compiling():
                    loss, _ = _frozen_linear_cross_entropy(
                        flat_output, weight, bias, flat_targets, target_weights, compute_dtype, label_smoothing, chunk_size
                    )

                    return loss

                loss = _LinearCrossEntropyWithForwardGrads.apply(  # type: ignore[no-untyped-call]
                    flat_output, weight, bias, flat_targets, target_weights, compute_dtype, label_smoothing, chunk_size
                )

                return loss

            if torch.compiler.is_compiling():
                loss, _, _ = _fused_linear_cross_entropy(
                    flat_output, weight, bias, flat_targets, target_weights, compute_dtype, label_smoothing, chunk_size
                )

                return loss

            loss = _FusedLinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
                flat_output, weight, bias, flat_targets, target_weights, compute_dtype, label_smoothing, chunk_size
            )

            return loss

    chunk_reduction: Literal["sum", "none"] = "none" if reduction == "none" else "sum"

    compute_chunk = partial(
        _compute_chunk_loss,
        final_proj,
        pad_idx=pad_idx,
        label_smoothing=label_smoothing,
        reduction=chunk_reduction,
    )

    chunk_losses = []

    for begin in range(0, flat_targets.size(0), chunk_size):
        end = begin + chunk_size

        chunk_output = flat_output[begin:end]
        chunk_targets = flat_targets[begin:end]
        chunk_mask = None if flat_mask is None else flat_mask[begin:end]

        if torch.is_grad_enabled():
            # Non-reentrant checkpointing keeps only the chunk's inputs; the
            # logits are recomputed in the backward pass.
            chunk_loss = checkpoint(
                compute_chunk,
                chunk_output,
                chunk_targets,
                chunk_mask,
                use_reentrant=False,
                preserve_rng_state=False,
            )
        else:
            chunk_loss = compute_chunk(chunk_output, chunk_targets, chunk_mask)

        chunk_losses.append(chunk_loss)

    if reduction == "none":
        if not chunk_losses:
            return flat_output.new_zeros(targets.shape, dtype=torch.float32)

        return torch.cat(chunk_losses).view(targets.shape)

    if not chunk_losses:
        loss = flat_output.new_zeros((), dtype=torch.float32)
    else:
        loss = torch.stack(chunk_losses).sum()

    if reduction == "sum":
        return loss

    return loss / _count_loss_targets(flat_targets, pad_idx, flat_mask)


def _compute_chunk_loss(
    final_proj: Projection,
    chunk_output: Tensor,
    chunk_targets: Tensor,
    chunk_mask: Tensor | None,
    *,
    pad_idx: int | None,
    label_smoothing: float,
    reduction: Literal["sum", "none"],
) -> Tensor:
    logits = final_proj(chunk_output)

    return cross_entropy(
        logits,
        chunk_targets,
        pad_idx,
        label_smoothing=label_smoothing,
        target_mask=chunk_mask,
        reduction=reduction,
    )


def _get_plain_projection_params(proj: Projection) -> tuple[Tensor, Tensor | None] | None:
    """Returns the weight and bias of ``proj`` if it computes ``x W^T + b``
    on its own (not tensor-parallel)."""
    if isinstance(proj, ColumnShardedLinear) and proj.sharded:
        return None

    # A tuple, not a union: dynamo cannot trace `isinstance` with a union.
    if isinstance(proj, (TiedProjection, Linear, ColumnShardedLinear)):
        return proj.weight, proj.bias

    return None


def _get_target_weights(
    targets: Tensor, pad_idx: int | None, target_mask: Tensor | None
) -> Tensor:
    """Returns 1 for the targets that count in the loss and 0 for the others
    (pad targets and those outside ``target_mask``), as fp32."""
    if target_mask is None:
        weights = torch.ones_like(targets, dtype=torch.float32)
    else:
        weights = target_mask.to(torch.float32)

    if pad_idx is not None:
        weights = weights * targets.ne(pad_idx)

    return weights


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Computes ``sum_i w_i CE(x_i W^T + b, t_i)`` over blocks of classes,
    each spanning all tokens; ``w_i`` includes the ``1 / count`` of a mean.

    With label smoothing ``e`` and ``V`` classes, the loss of a token is
    ``(1 - e - e') nll + e' smooth`` with ``e' = e / (V - 1)``, ``nll = lse -
    z_t`` and ``smooth = V lse - sum_j z_j``, as in
    :func:`fairseq2.nn.functional.cross_entropy`; its gradient with respect to
    the logits is ``(1 - e - e' + e' V) p - (1 - e - e') onehot(t) - e'``.

    The forward pass keeps only each token's log-sum-exp (as two numbers).
    The backward pass recomputes the logits block by block and forms their
    gradient in fp32, multiplied by ``grad_output`` before it is rounded to
    the compute dtype: under fp16 the loss scale arrives in ``grad_output``,
    and the probabilities of a large vocabulary (1e-6 and below) are
    representable only once scaled. Because a block spans all tokens, its
    rows of the weight gradient are one GEMM written into place (no ``(V,
    M)`` fp32 accumulator), and only the ``(N, M)`` gradient of ``x``
    accumulates over the blocks, in fp32.
    """

    @staticmethod
    @autocast_free
    def forward(
        ctx: Any,
        inputs: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        target_weights: Tensor,
        compute_dtype: torch.dtype,
        label_smoothing: float,
        chunk_size: int,
    ) -> Tensor:
        loss, max_logits, log_sum_exps = _fused_forward(
            inputs, weight, bias, targets, target_weights, compute_dtype, label_smoothing, chunk_size
        )

        ctx.save_for_backward(inputs, weight, bias, targets, target_weights, max_logits, log_sum_exps)

        ctx.compute_dtype = compute_dtype
        ctx.label_smoothing = label_smoothing
        ctx.chunk_size = chunk_size

        return loss

    @staticmethod
    @autocast_free
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grads = _fused_backward(
            grad_output, *ctx.saved_tensors, ctx.compute_dtype, ctx.label_smoothing, ctx.chunk_size,
            *ctx.needs_input_grad[:3],
        )  # fmt: skip

        return *grads, None, None, None, None, None


def _fused_forward(
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    target_weights: Tensor,
    compute_dtype: torch.dtype,
    label_smoothing: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The forward pass of :class:`_FusedLinearCrossEntropy`.

    :returns: The loss, and each token's log-sum-exp as its maximum logit and
        the log of its sum of exponentials, which the backward pass needs.
    """
    num_classes = weight.size(0)

    _check_targets(targets, num_classes)

    block_size = _class_block_size(targets.size(0), num_classes, chunk_size)

    # Each token's log-sum-exp, kept as ``max + log(sum)`` (as
    # `log_softmax` computes it): the backward pass subtracts the two in
    # turn, which leaves the log-probabilities exact to a few of their
    # own ulps instead of those of the logits.
    max_logits = torch.full_like(target_weights, -math.inf)

    sum_exps = torch.zeros_like(target_weights)

    target_logits = torch.zeros_like(target_weights)

    logit_sums = torch.zeros_like(target_weights)

    compute_inputs = _product_operand(inputs, compute_dtype)

    for begin in range(0, num_classes, block_size):
        _, logits, block_targets, in_block = _block_logits(
            compute_inputs, weight, bias, targets, begin, block_size, compute_dtype, chunk_size * num_classes
        )

        block_target_logits = logits.gather(-1, block_targets).squeeze(-1)

        target_logits = torch.where(in_block, block_target_logits, target_logits)

        if label_smoothing > 0.0:
            logit_sums += logits.sum(-1)

        new_max_logits = torch.maximum(max_logits, logits.amax(-1))

        sum_exps = sum_exps * (max_logits - new_max_logits).exp()

        sum_exps += logits.sub_(new_max_logits.unsqueeze(-1)).exp_().sum(-1)

        max_logits = new_max_logits

        # Frees the block before the next one is computed.
        del logits

    log_sum_exps = sum_exps.log()

    token_loss = _token_losses(
        max_logits, log_sum_exps, target_logits, logit_sums, num_classes, label_smoothing
    )

    return (token_loss * target_weights).sum(), max_logits, log_sum_exps


def _fused_backward(
    grad_output: Tensor,
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    target_weights: Tensor,
    max_logits: Tensor,
    log_sum_exps: Tensor,
    compute_dtype: torch.dtype,
    label_smoothing: float,
    chunk_size: int,
    need_input_grad: bool,
    need_weight_grad: bool,
    need_bias_grad: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The backward pass of :class:`_FusedLinearCrossEntropy`, which
    recomputes the logits block by block.

    :returns: The gradients of ``inputs``, ``weight`` and ``bias``, ``None``
        for those not needed.
    """
    num_classes = weight.size(0)

    block_size = _class_block_size(targets.size(0), num_classes, chunk_size)

    # Scales each token's logit gradient in fp32, before any rounding.
    # *Shape:* (N, 1)
    token_scales = (target_weights * grad_output).unsqueeze(-1)

    max_logits, log_sum_exps = max_logits.unsqueeze(-1), log_sum_exps.unsqueeze(-1)

    compute_inputs = _product_operand(inputs, compute_dtype)

    max_piece_numel = chunk_size * num_classes

    input_grad = torch.zeros_like(inputs, dtype=torch.float32) if need_input_grad else None

    weight_grad = torch.empty_like(weight) if need_weight_grad else None

    bias_grad = torch.empty_like(bias) if need_bias_grad else None

    for begin in range(0, num_classes, block_size):
        block_weight, logits, block_targets, in_block = _block_logits(
            compute_inputs, weight, bias, targets, begin, block_size, compute_dtype, max_piece_numel
        )

        end = begin + block_weight.size(0)

        # The gradient of the loss with respect to the block's logits, in
        # place of them.
        grad = _logit_grads_(
            logits.sub_(max_logits).sub_(log_sum_exps).exp_(),
            block_targets,
            in_block,
            token_scales,
            label_smoothing,
            num_classes,
        )

        if bias_grad is not None:
            bias_grad[begin:end] = grad.sum(0)

        grad = _logit_grad_operand(grad, compute_dtype)

        if weight_grad is not None:
            _weight_grad_product(
                weight_grad[begin:end], grad, compute_inputs, compute_dtype, max_piece_numel, accumulate=False
            )

        if input_grad is not None:
            _add_input_grad(input_grad, grad, block_weight, max_piece_numel)

        # Frees the block before the next one is computed.
        del grad, logits

    if input_grad is not None:
        input_grad = input_grad.to(inputs.dtype)

    return input_grad, weight_grad, bias_grad


@torch.library.custom_op("qwen35_fs2::fused_linear_cross_entropy", mutates_args=())
@autocast_free
def _fused_linear_cross_entropy(
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    target_weights: Tensor,
    compute_dtype: torch.dtype,
    label_smoothing: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """:class:`_FusedLinearCrossEntropy` as an operator, for
    ``torch.compile``.

    Traced, the function's backward pass recomputes the forward pass's
    logits with the same operations on the same inputs: AOTAutograd merges
    the two (common subexpressions of the joint graph) and keeps every block
    of logits from the forward pass to the backward pass, all ``N x V`` of
    them, the memory this loss exists to avoid (1.9 GiB in bf16 for 4,096
    tokens of Qwen3.5's vocabulary). Opaque, the operator keeps what the
    function keeps, and its loops over the class blocks stay out of the
    graph, so that the blocks are those of eager mode for every token count.

    :returns: The loss, and the per-token maximum logits and log-sums of
        exponentials that the backward operator needs.
    """
    return _fused_forward(
        inputs, weight, bias, targets, target_weights, compute_dtype, label_smoothing, chunk_size
    )


@_fused_linear_cross_entropy.register_fake
def _(
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    target_weights: Tensor,
    compute_dtype: torch.dtype,
    label_smoothing: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    return target_weights.new_empty(()), torch.empty_like(target_weights), torch.empty_like(target_weights)


@torch.library.custom_op("qwen35_fs2::fused_linear_cross_entropy_backward", mutates_args=())
@autocast_free
def _fused_linear_cross_entropy_backward(
    grad_output: Tensor,
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    target_weights: Tensor,
    max_logits: Tensor,
    log_sum_exps: Tensor,
    compute_dtype: torch.dtype,
    label_smoothing: float,
    chunk_size: int,
    need_input_grad: bool,
    need_weight_grad: bool,
    need_bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward pass of ``qwen35_fs2::fused_linear_cross_entropy``: the
    gradients of ``inputs``, ``weight`` and ``bias``, each empty if not
    needed."""
    grads = _fused_backward(
        grad_output, inputs, weight, bias, targets, target_weights, max_logits, log_sum_exps,
        compute_dtype, label_smoothing, chunk_size, need_input_grad, need_weight_grad, need_bias_grad,
    )  # fmt: skip

    return tuple(empty_output(inputs) if grad is None else grad for grad in grads)  # type: ignore[return-value]


@_fused_linear_cross_entropy_backward.register_fake
def _(
    grad_output: Tensor,
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    target_weights: Tensor,
    max_logits: Tensor,
    log_sum_exps: Tensor,
    compute_dtype: torch.dtype,
    label_smoothing: float,
    chunk_size: int,
    need_input_grad: bool,
    need_weight_grad: bool,
    need_bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    grads = ((inputs, need_input_grad), (weight, need_weight_grad), (bias, need_bias_grad))

    return tuple(  # type: ignore[return-value]
        torch.empty_like(t) if need and t is not None else empty_output(inputs) for t, need in grads
    )


def _setup_fused_linear_cross_entropy_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    x, weight, bias, targets, target_weights, compute_dtype, label_smoothing, chunk_size = inputs

    _, max_logits, log_sum_exps = output

    # Kept for the backward pass, not results.
    ctx.mark_non_differentiable(max_logits, log_sum_exps)

    ctx.save_for_backward(x, weight, bias, targets, target_weights, max_logits, log_sum_exps)

    ctx.compute_dtype = compute_dtype
    ctx.label_smoothing = label_smoothing
    ctx.chunk_size = chunk_size


def _fused_linear_cross_entropy_autograd(
    ctx: Any, grad_output: Tensor, *_: Tensor
) -> tuple[Tensor | None, ...]:
    grads = torch.ops.qwen35_fs2.fused_linear_cross_entropy_backward(
        grad_output, *ctx.saved_tensors, ctx.compute_dtype, ctx.label_smoothing, ctx.chunk_size,
        *ctx.needs_input_grad[:3],
    )  # fmt: skip

    return *(output_grad(grad) for grad in grads), None, None, None, None, None


_fused_linear_cross_entropy.register_autograd(
    _fused_linear_cross_entropy_autograd, setup_context=_setup_fused_linear_cross_entropy_context
)


def _gradients_in_forward(
    num_tokens: int, chunk_size: int, weight: Tensor, bias: Tensor | None, compute_dtype: torch.dtype
) -> bool:
    """Whether the fused loss computes its gradients in its forward pass
    (:class:`_LinearCrossEntropyWithForwardGrads`: the logits once, three
    products of the projection's size) rather than in its backward pass
    (:class:`_FusedLinearCrossEntropy`: the logits twice, four).

    Only where the gradients come out as exactly and the step's peak memory
    stays the same:

    - not in fp16: the loss scale arrives in the backward pass, and the
      probabilities of a large vocabulary underflow in fp16 unless scaled
      before they are rounded;
    - with more than one chunk of tokens, the weight must be in the compute
      dtype (under autocast, a cast copy of the whole weight would be held
      through the chunks, where the other path casts a block at a time), and
      its gradient, if needed, is summed over the chunks, exactly only in
      place in fp32 (a bf16 one would be rounded once per chunk);
    - under ``torch.compile``, only for a frozen projection in the compute
      dtype with gradients enabled, whatever the token count, as the
      operator :func:`_frozen_linear_cross_entropy`: traced, the loop over
      chunks of tokens would specialize the graph on the token count, and an
      operator cannot scale its saved gradients in place, so that a weight
      gradient would be held twice as the backward pass starts (without
      gradients, as in validation, the other way computes the logits once).

    Frozen LM heads (LoRA) qualify in bf16 as in fp32.
    """
    if compute_dtype == torch.float16:
        return False

    if torch.compiler.is_compiling():
        frozen = not weight.requires_grad and (bias is None or not bias.requires_grad)

        return frozen and weight.dtype == compute_dtype and torch.is_grad_enabled()

    if num_tokens <= chunk_size:
        return True

    if weight.dtype != compute_dtype:
        return False

    return not weight.requires_grad or weight.dtype == torch.float32


class _LinearCrossEntropyWithForwardGrads(torch.autograd.Function):
    """Computes the loss of :class:`_FusedLinearCrossEntropy` over chunks of
    ``chunk_size`` tokens, each with all classes, and its gradients in the
    same pass: each chunk's logits are computed once, turned into their
    gradient in place, and multiplied into the gradients of ``x`` (written
    in place) and of the weight (accumulated in place).

    What the forward pass keeps for the backward pass is the gradients
    themselves, which the backward pass only multiplies by ``grad_output``:
    exactly when that is ``1`` (fairseq2's trainer calls ``loss.backward()``
    and divides the gradients by the number of targets afterwards) or a
    power of two; otherwise a bf16 gradient is rounded a second time. They
    are the tensors :class:`_FusedLinearCrossEntropy` allocates as its
    backward pass starts, when the model's activations are as large as when
    its forward pass ends: the step's peak is the same. Where this is used:
    :func:`_gradients_in_forward`.
    """

    @staticmethod
    @autocast_free
    def forward(
        ctx: Any,
        inputs: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        target_weights: Tensor,
        compute_dtype: torch.dtype,
        label_smoothing: float,
        chunk_size: int,
    ) -> Tensor:
        loss, input_grad, weight_grad, bias_grad = _forward_grads(
            inputs, weight, bias, targets, target_weights, compute_dtype, label_smoothing, chunk_size,
            *ctx.needs_input_grad[:3],
        )  # fmt: skip

        ctx.save_for_backward(input_grad, weight_grad, bias_grad)

        ctx.input_dtype = inputs.dtype

        ctx.gave_gradients = False

        return loss

    @staticmethod
    @autocast_free
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        # The gradients are scaled in place: a copy would double the weight
        # gradient's memory as the backward pass starts.
        if ctx.gave_gradients:
            raise RuntimeError(
                "The fused LM-head loss computes its gradients in its forward pass and gives them up in its first backward pass, but a second backward pass (`retain_graph=True`) reached it. Compute the loss again for each backward pass."
            )

        ctx.gave_gradients = True

        input_grad, weight_grad, bias_grad = ctx.saved_tensors

        if input_grad is not None:
            input_grad = input_grad.mul_(grad_output).to(ctx.input_dtype)

        if weight_grad is not None:
            weight_grad.mul_(grad_output)

        if bias_grad is not None:
            bias_grad.mul_(grad_output)

        return input_grad, weight_grad, bias_grad, None, None, None, None, None


def _forward_grads(
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    target_weights: Tensor,
    compute_dtype: torch.dtype,
    label_smoothing: float,
    chunk_size: int,
    need_input_grad: bool,
    need_weight_grad: bool,
    need_bias_grad: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The forward pass of :class:`_LinearCrossEntropyWithForwardGrads`.

    :returns: The loss and the gradients of ``inputs`` (in fp32), ``weight``
        and ``bias`` for a ``grad_output`` of 1, ``None`` for those not
        needed.
    """
    num_classes = weight.size(0)

    _check_targets(targets, num_classes)

    compute_inputs = _product_operand(inputs, compute_dtype)

    # A copy under autocast, in one chunk only (see `_gradients_in_forward`).
    compute_weight = weight.to(compute_dtype)

    max_piece_numel = chunk_size * num_classes

    input_grad = torch.zeros_like(inputs, dtype=torch.float32) if need_input_grad else None

    weight_grad = torch.zeros_like(weight) if need_weight_grad else None

    # Summed over the chunks in fp32, then cast.
    bias_grad = torch.zeros_like(bias, dtype=torch.float32) if need_bias_grad else None  # type: ignore[arg-type]

    loss = target_weights.new_zeros(())

    for begin in range(0, targets.size(0), chunk_size):
        end = begin + chunk_size

        chunk_inputs = compute_inputs[begin:end]

        _, logits, chunk_targets, in_block = _block_logits(
            chunk_inputs, compute_weight, bias, targets[begin:end], 0, num_classes, compute_dtype, max_piece_numel
        )

        target_logits = logits.gather(-1, chunk_targets)

        logit_sums = logits.sum(-1, keepdim=True) if label_smoothing > 0.0 else None

        max_logits = logits.amax(-1, keepdim=True)

        # The probabilities, in place of the logits.
        probs = logits.sub_(max_logits).exp_()

        sum_exps = probs.sum(-1, keepdim=True)

        token_loss = _token_losses(
            max_logits, sum_exps.log(), target_logits, logit_sums, num_classes, label_smoothing
        )

        chunk_weights = target_weights[begin:end].unsqueeze(-1)

        loss += (token_loss * chunk_weights).sum()

        grad = _logit_grads_(
            probs.div_(sum_exps), chunk_targets, in_block, chunk_weights, label_smoothing, num_classes
        )

        if bias_grad is not None:
            bias_grad += grad.sum(0)

        grad = _logit_grad_operand(grad, compute_dtype)

        if weight_grad is not None:
            # An fp32 weight under autocast comes in one chunk only (see
            # `_gradients_in_forward`).
            _weight_grad_product(weight_grad, grad, chunk_inputs, compute_dtype, max_piece_numel, accumulate=True)

        if input_grad is not None:
            _add_input_grad(input_grad[begin:end], grad, compute_weight, max_piece_numel)

        # Frees the chunk before the next one is computed.
        del grad, logits, probs

    if bias_grad is not None:
        bias_grad = bias_grad.to(bias.dtype)  # type: ignore[union-attr]

    return loss, input_grad, weight_grad, bias_grad


@torch.library.custom_op("qwen35_fs2::frozen_linear_cross_entropy", mutates_args=())
@autocast_free
def _frozen_linear_cross_entropy(
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    target_weights: Tensor,
    compute_dtype: torch.dtype,
    label_smoothing: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """:class:`_LinearCrossEntropyWithForwardGrads` for a frozen projection
    (LoRA) as an operator, for ``torch.compile``: the logits once, two
    products of the projection's size, where the other way takes three.

    :returns: The loss, and the fp32 gradient of ``inputs`` for a
        ``grad_output`` of 1, which the backward pass scales.
    """
    loss, input_grad, _, _ = _forward_grads(
        inputs, weight, bias, targets, target_weights, compute_dtype, label_smoothing, chunk_size,
        True, False, False,
    )  # fmt: skip

    if input_grad is None:
        raise InternalError("`_forward_grads()` returned no input gradient.")

    return loss, input_grad


@_frozen_linear_cross_entropy.register_fake
def _(
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    target_weights: Tensor,
    compute_dtype: torch.dtype,
    label_smoothing: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    return target_weights.new_empty(()), torch.empty_like(inputs, dtype=torch.float32)


def _setup_frozen_linear_cross_entropy_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    _, input_grad = output

    # Kept for the backward pass, not a result.
    ctx.mark_non_differentiable(input_grad)

    ctx.save_for_backward(input_grad)

    ctx.input_dtype = inputs[0].dtype


def _frozen_linear_cross_entropy_autograd(
    ctx: Any, grad_output: Tensor, _: Tensor
) -> tuple[Tensor | None, ...]:
    if any(ctx.needs_input_grad[1:3]):
        raise InternalError("The frozen LM-head loss got a projection that needs its gradient.")

    input_grad, = ctx.saved_tensors

    return (input_grad * grad_output).to(ctx.input_dtype), None, None, None, None, None, None, None


_frozen_linear_cross_entropy.register_autograd(
    _frozen_linear_cross_entropy_autograd, setup_context=_setup_frozen_linear_cross_entropy_context
)


def _smoothing_coeffs(label_smoothing: float, num_classes: int) -> tuple[float, float]:
    """Returns ``e'`` and ``1 - e - e'`` of :class:`_FusedLinearCrossEntropy`."""
    smoothing = label_smoothing / (num_classes - 1) if label_smoothing > 0.0 else 0.0

    return smoothing, 1.0 - label_smoothing - smoothing


def _check_targets(targets: Tensor, num_classes: int) -> None:
    """Fails, as an index out of range would in `cross_entropy`, if a target
    is not a class; without a device synchronisation."""
    torch._assert_async(
        ((targets >= 0) & (targets < num_classes)).all(),
        f"`targets` must be class indices in [0, {num_classes}), but some are not.",
    )


def _token_losses(
    max_logits: Tensor,
    log_sum_exps: Tensor,
    target_logits: Tensor,
    logit_sums: Tensor | None,
    num_classes: int,
    label_smoothing: float,
) -> Tensor:
    """Returns each token's loss from its log-sum-exp (as ``max_logits +
    log_sum_exps``), its target's logit and, with label smoothing, the sum of
    its logits (``None`` without); see :class:`_FusedLinearCrossEntropy`."""
    smoothing, nll_coeff = _smoothing_coeffs(label_smoothing, num_classes)

    token_loss = nll_coeff * (max_logits - target_logits + log_sum_exps)

    if smoothing > 0.0:
        if logit_sums is None:
            raise InternalError("`logit_sums` is `None` with label smoothing.")

        lse = max_logits + log_sum_exps

        token_loss = token_loss + smoothing * (num_classes * lse - logit_sums)

    return token_loss


def _logit_grads_(
    probs: Tensor,
    block_targets: Tensor,
    in_block: Tensor,
    token_scales: Tensor,
    label_smoothing: float,
    num_classes: int,
) -> Tensor:
    """Turns ``probs``, the fp32 probabilities of a block of the
    ``num_classes`` classes (``(N, C)``), into the gradient of the loss with
    respect to their logits, in place, each token's row multiplied by
    ``token_scales`` (``(N, 1)``) before any rounding; see
    :class:`_FusedLinearCrossEntropy` for the formula."""
    smoothing, nll_coeff = _smoothing_coeffs(label_smoothing, num_classes)

    grad = probs.mul_(nll_coeff + smoothing * num_classes)

    grad.scatter_add_(-1, block_targets, in_block.unsqueeze(-1).to(grad.dtype).mul_(-nll_coeff))

    if smoothing > 0.0:
        grad.sub_(smoothing)

    return grad.mul_(token_scales)


def _class_block_size(num_tokens: int, num_classes: int, chunk_size: int) -> int:
    """Returns the number of classes whose logits for ``num_tokens`` tokens
    are at most as many as all the logits of ``chunk_size`` tokens."""
    if num_tokens <= chunk_size:
        return num_classes

    return max(1, chunk_size * num_classes // num_tokens)


def _products_in_fp32(compute_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the loss multiplies its operands in ``compute_dtype`` as fp32
    products of their values in that dtype.

    PyTorch multiplies bf16 matrices on the CPU with oneDNN only on CPUs with
    AVX-512, and fp16 ones only with AVX-512-FP16 or AMX; elsewhere its own
    GEMM runs them in scalar code, 1 to 20 GFLOP/s where fp32 runs at 100 and
    more (an AVX2 EPYC; docs/performance.md, "The LM-head loss's bf16
    products in fp32 on the CPU"). A product of two bf16 or fp16 numbers is
    exact in fp32, and oneDNN's and CUDA's GEMMs sum such products in fp32
    too: fp32 products of the same values, with the logits rounded to the
    dtype afterwards, compute the forward pass as the dtype's GEMM does, up to
    the order of the sums. The gradients stay in fp32 until they are stored
    (the weight's in its own dtype), which the dtype's GEMM would round once
    more. On the CPU the loss multiplies so on every CPU alike, so that a run
    computes the same wherever it runs; CUDA multiplies in the dtype itself.
    """
    return device.type == "cpu" and compute_dtype in (torch.bfloat16, torch.float16)


def _product_operand(t: Tensor, compute_dtype: torch.dtype) -> Tensor:
    """Returns ``t`` in ``compute_dtype``, as the loss's products take it: in
    fp32 holding the dtype's values where they run in fp32 (see
    :func:`_products_in_fp32`)."""
    t = t.to(compute_dtype)

    return t.float() if _products_in_fp32(compute_dtype, t.device) else t


def _logit_grad_operand(grad: Tensor, compute_dtype: torch.dtype) -> Tensor:
    """Returns the fp32 logit gradient ``grad`` as the loss's products take
    it: as it is where they run in fp32 (see :func:`_products_in_fp32`), a
    copy in ``compute_dtype`` otherwise."""
    return grad if _products_in_fp32(compute_dtype, grad.device) else grad.to(compute_dtype)


def _piece_bounds(num_rows: int, model_dim: int, max_piece_numel: int) -> list[tuple[int, int]]:
    """Splits ``num_rows`` rows of the weight into pieces of at most half of
    ``max_piece_numel`` elements (those of the largest block of logits the
    loss holds), for the products of :func:`_products_in_fp32`: what they
    hold beside the logits (a piece of the weight in fp32, or its rows of the
    weight gradient in fp32, and a piece of the logits rounded) then stays
    under one block of logits, where a whole block of the weight is larger
    if the model dimension exceeds the token count (1.2 GiB against 242 MiB
    in bf16 at Qwen3.5-27B's shapes). The pieces depend on the weight's
    shape only, so that ``torch.compile`` sees the same ones for every token
    count."""
    piece_rows = max(1, max_piece_numel // (2 * model_dim))

    return [(begin, min(begin + piece_rows, num_rows)) for begin in range(0, num_rows, piece_rows)]


def _product_pieces(
    num_rows: int, model_dim: int, compute_dtype: torch.dtype, device: torch.device, max_piece_numel: int
) -> list[tuple[int, int]]:
    """The pieces of ``num_rows`` rows of the weight that the loss multiplies
    at once: those of :func:`_piece_bounds` where the products run in fp32
    (:func:`_products_in_fp32`), all rows in one otherwise."""
    if _products_in_fp32(compute_dtype, device):
        return _piece_bounds(num_rows, model_dim, max_piece_numel)

    return [(0, num_rows)]


def _block_logits(
    inputs: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    begin: int,
    block_size: int,
    compute_dtype: torch.dtype,
    max_piece_numel: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns, for the block of ``block_size`` classes from ``begin``: its
    rows of ``weight`` in ``compute_dtype``, its fp32 logits (the product's
    in ``compute_dtype``), each target's index in the block (clamped into it)
    as a column, and whether the target is in the block. ``inputs`` is as
    :func:`_product_operand` returns it.

    Only the block's rows of ``weight`` are cast, so that an fp32 weight
    under autocast is never copied whole."""
    block_weight = weight[begin : begin + block_size].to(compute_dtype)

    block_bias = None if bias is None else bias[begin : begin + block_size].to(compute_dtype)

    # For numerical stability, the softmax runs in fp32.
    if not _products_in_fp32(compute_dtype, inputs.device):
        logits = F.linear(inputs, block_weight, block_bias).float()
    else:
        num_rows, model_dim = block_weight.shape

        logits = inputs.new_empty((inputs.size(0), num_rows))

        for piece_begin, piece_end in _piece_bounds(num_rows, model_dim, max_piece_numel):
            piece_logits = logits[:, piece_begin:piece_end]

            piece_weight = block_weight[piece_begin:piece_end].float()

            if block_bias is None:
                torch.mm(inputs, piece_weight.t(), out=piece_logits)
            else:
                # The bias is added before the one rounding, as a GEMM's
                # epilogue adds it.
                torch.addmm(block_bias[piece_begin:piece_end].float(), inputs, piece_weight.t(), out=piece_logits)

            # Frees the copy before the rounding's own.
            del piece_weight

            piece_logits.copy_(piece_logits.to(compute_dtype))

    offsets = targets - begin

    in_block = (offsets >= 0) & (offsets < block_weight.size(0))

    block_targets = offsets.clamp(0, block_weight.size(0) - 1).unsqueeze(-1)

    return block_weight, logits, block_targets, in_block


def _weight_grad_product(
    weight_grad: Tensor,
    grad: Tensor,
    inputs: Tensor,
    compute_dtype: torch.dtype,
    max_piece_numel: int,
    *,
    accumulate: bool,
) -> None:
    """Writes ``grad^T @ inputs``, the gradient of the rows of the weight
    that ``weight_grad`` holds, into it, or adds it with ``accumulate``.
    ``grad`` is as :func:`_logit_grad_operand` returns it, ``inputs`` as
    :func:`_product_operand` does.

    Where the products run in fp32 (:func:`_products_in_fp32`), they are
    made piece by piece (:func:`_piece_bounds`) and rounded only as they are
    stored: an fp32 ``weight_grad`` under autocast takes them whole."""
    num_rows, model_dim = weight_grad.shape

    for begin, end in _product_pieces(num_rows, model_dim, compute_dtype, grad.device, max_piece_numel):
        piece_grad, piece = grad[:, begin:end], weight_grad[begin:end]

        if piece.dtype != grad.dtype:
            _store_product_(piece, piece_grad.t() @ inputs, accumulate)
        elif accumulate:
            torch.addmm(piece, piece_grad.t(), inputs, out=piece)
        else:
            torch.mm(piece_grad.t(), inputs, out=piece)


def _store_product_(out: Tensor, product: Tensor, accumulate: bool) -> None:
    """Writes ``product``, a temporary of another dtype, into ``out``, or adds
    it with ``accumulate``. An fp32 product takes the sum itself before it is
    rounded into ``out`` (measured: a smaller peak than ``out.add_()``); a
    product in the compute dtype is added to the wider ``out``."""
    if not accumulate:
        out.copy_(product)
    elif product.dtype == torch.float32:
        out.copy_(product.add_(out))
    else:
        out.add_(product)


def _add_input_grad(input_grad: Tensor, grad: Tensor, block_weight: Tensor, max_piece_numel: int) -> None:
    """Adds ``grad @ block_weight``, the block's part of the gradient of the
    decoder output, to the fp32 ``input_grad``. ``grad`` is as
    :func:`_logit_grad_operand` returns it.

    Where the products run in fp32 (:func:`_products_in_fp32`), the weight
    is copied to fp32 piece by piece (:func:`_piece_bounds`), and each
    piece's product is added unrounded."""
    num_rows, model_dim = block_weight.shape

    for begin, end in _product_pieces(num_rows, model_dim, block_weight.dtype, grad.device, max_piece_numel):
        piece_grad, piece_weight = grad[:, begin:end], block_weight[begin:end].to(grad.dtype)

        if grad.dtype == input_grad.dtype:
            torch.addmm(input_grad, piece_grad, piece_weight, out=input_grad)
        else:
            input_grad += piece_grad @ piece_weight


def _count_loss_targets(
    targets: Tensor, pad_idx: int | None, target_mask: Tensor | None
) -> Tensor:
    """Returns the denominator of ``reduction='mean'``, as
    :func:`cross_entropy` counts it."""
    counted = _counted_targets(targets, pad_idx, target_mask)

    if counted is None:
        return torch.tensor(targets.numel(), device=targets.device)

    return counted.sum()


def _counted_targets(
    targets: Tensor, pad_idx: int | None, target_mask: Tensor | None
) -> Tensor | None:
    """Returns where a target counts in the loss (not the pad index, inside
    ``target_mask``), ``None`` if every target does."""
    if pad_idx is None:
        return target_mask

    counted = targets.ne(pad_idx)

    if target_mask is not None:
        counted = counted & target_mask

    return counted


def install_chunked_lm_loss(
    model: TransformerLM,
    *,
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    mtp_loss: MtpLossMode = "off",
) -> TransformerLM:
    """Makes ``model(seqs, layout, targets, ...)`` compute its loss with
    :func:`chunked_cross_entropy`, and returns ``model``.

    With ``mtp_loss`` ``"train"``, the same call computes the loss of the
    model's MTP head too (:func:`compute_mtp_loss`); with ``"eval"``, only
    when the model is in evaluation mode (the head's loss and acceptance are
    measured, not trained). :meth:`~qwen35_fs2.nn.mtp.Qwen35MultiTokenPredictor.pop_loss`
    then returns it, and the model's return value stays its next-token loss.
    It runs
    in the model's forward pass, so that FSDP, DDP and autocast treat the head
    as the rest of the model.

    The training recipes install it on the model they train
    (:func:`~qwen35_fs2.recipes.common.setup_lm_loss`); call it on a model
    trained by other code, which otherwise gets fairseq2's loss, whose fp32
    logits of the whole batch take ``num_tokens * 248320 * 4`` bytes.

    :class:`TransformerLM` is final, so its ``compute_fused_loss`` is replaced
    on the instance, as fairseq2's own ``compile_loss`` does.
    """
    if mtp_loss not in ("off", "eval", "train"):
        raise ValueError(f"`mtp_loss` must be 'off', 'eval' or 'train', but is '{mtp_loss}' instead.")

    if mtp_loss != "off":
        if not isinstance(getattr(model, "mtp", None), Qwen35MultiTokenPredictor):
            raise ValueError(
                f"`model` must have an MTP head (`model.mtp`) when `mtp_loss` is '{mtp_loss}', but has none. Build it with `mtp_num_layers: 1`."
            )

        # The loss gets the trunk's output, but the head needs the layout.
        model.register_forward_pre_hook(pass_batch_layout_to_mtp, with_kwargs=True)

    # A Python function, not a `partial`: `compile_loss` compiles this
    # method, and dynamo cannot trace a method whose function is a `partial`.
    def compute_fused_loss(model: TransformerLM, decoder_output: Tensor, targets: Tensor, **kwargs: Any) -> Tensor:
        return _compute_chunked_fused_loss(
            model, decoder_output, targets, chunk_size=chunk_size, mtp_loss=mtp_loss, **kwargs
        )

    model.compute_fused_loss = MethodType(compute_fused_loss, model)  # type: ignore[method-assign]

    return model


def _compute_chunked_fused_loss(
    model: TransformerLM,
    decoder_output: Tensor,
    targets: Tensor,
    *,
    label_smoothing: float = 0.0,
    target_mask: Tensor | None = None,
    reduction: Literal["sum", "mean"] = "sum",
    chunk_size: int,
    mtp_loss: MtpLossMode,
) -> Tensor:
    loss = chunked_cross_entropy(
        decoder_output,
        model.final_proj,
        targets,
        model.pad_idx,
        label_smoothing=label_smoothing,
        target_mask=target_mask,
        reduction=reduction,
        chunk_size=chunk_size,
    )

    if mtp_loss == "train" or (mtp_loss == "eval" and not model.training):
        mtp = model.mtp

        if not isinstance(mtp, Qwen35MultiTokenPredictor):
            raise InternalError(f"`model.mtp` is of type `{type(mtp)}`.")

        mtp.set_loss(
            compute_mtp_loss(
                model,
                mtp,
                decoder_output,
                mtp.pop_batch_layout(),
                targets,
                target_mask,
                label_smoothing=label_smoothing,
                chunk_size=chunk_size,
                acceptance=not model.training,
            )
        )

    return loss


def compute_mtp_loss(
    model: TransformerLM,
    mtp: Qwen35MultiTokenPredictor,
    decoder_output: Tensor,
    seqs_layout: BatchLayout,
    targets: Tensor,
    target_mask: Tensor | None,
    *,
    label_smoothing: float = 0.0,
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    acceptance: bool = False,
) -> MtpLoss:
    """Returns the summed cross entropy of the MTP head's predictions of the
    token after next: at position ``t`` the head takes the trunk's output
    and the embedding of ``targets[t]`` and predicts ``targets[t + 1]``,
    counted only within a document, outside padding and inside
    ``target_mask`` (:func:`~qwen35_fs2.nn.mtp.mtp_target_mask`).

    :param decoder_output: The trunk's output on the input of
        ``seqs_layout``. *Shape:* :math:`(N,S,M)`, or :math:`(S,M)` if
        packed.
    :param targets: The next-token targets. *Shape:* :math:`(N,S)`, or
        :math:`(S)` if packed.
    :param acceptance: If ``True``, also counts the positions whose greedy
        draft the trunk's greedy token at the next position accepts
        (:attr:`MtpLoss.num_accepted`), from the logits of ``chunk_size``
        tokens at a time.
    """
    embed = model.decoder_frontend.embed  # type: ignore[union-attr]

    if not isinstance(embed, Module):
        raise InternalError(f"`model.decoder_frontend.embed` is of type `{type(embed)}`.")

    mtp_output = mtp(decoder_output, embed(targets), seqs_layout)

    mtp_targets = shift_mtp_targets(targets)

    mtp_mask = mtp_target_mask(seqs_layout, target_mask)

    nll_loss = chunked_cross_entropy(
        mtp_output,
        model.final_proj,
        mtp_targets,
        model.pad_idx,
        label_smoothing=label_smoothing,
        target_mask=mtp_mask,
        reduction="sum",
        chunk_size=chunk_size,
    )

    num_targets = _count_loss_targets(mtp_targets.flatten(), model.pad_idx, mtp_mask.flatten())

    if not acceptance:
        return MtpLoss(nll_loss, num_targets)

    with torch.no_grad():
        drafts = _greedy_tokens(mtp_output, model.final_proj, chunk_size)

        # The trunk's greedy token at t + 1 verifies the draft of t.
        verified = shift_mtp_targets(_greedy_tokens(decoder_output, model.final_proj, chunk_size))

        counted = _counted_targets(mtp_targets, model.pad_idx, mtp_mask)

        assert counted is not None  # `mtp_mask` is given.

        num_accepted = (drafts.eq(verified) & counted).sum()

    return MtpLoss(nll_loss, num_targets, num_accepted)


def _greedy_tokens(hidden: Tensor, final_proj: Projection, chunk_size: int) -> Tensor:
    """Returns the most likely token at each position of ``hidden``, from the
    logits of at most ``chunk_size`` positions at once."""
    flat_hidden = hidden.flatten(0, -2)

    tokens = [
        final_proj(flat_hidden[begin : begin + chunk_size]).argmax(-1)
        for begin in range(0, flat_hidden.size(0), chunk_size)
    ]

    return torch.cat(tokens).view(hidden.shape[:-1])
