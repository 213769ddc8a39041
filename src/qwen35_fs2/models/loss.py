"""A language-model loss that never materialises the logits of a whole batch.

With Qwen3.5's 248,320-entry vocabulary, fairseq2's
:meth:`TransformerLM.compute_fused_loss` holds the logits and their fp32
log-probabilities for every token of the batch at once: 16k tokens take about
16 GB for the log-probabilities alone. Here the final projection and the cross
entropy run over chunks of tokens, so that peak memory is one chunk's logits
instead of the batch's:

- when training with a summed or mean loss through a plain (tied or
  unsharded) projection, the forward pass computes each chunk's gradients
  with respect to the decoder output and the projection right away, from the
  chunk's softmax, and frees the chunk (as Liger-Kernel's fused linear cross
  entropy does); the backward pass only scales them. This also skips the
  second projection that recomputing the logits would take;
- otherwise each chunk is checkpointed: its logits are freed after the
  forward pass and recomputed, one chunk at a time, in the backward pass.

The semantics are those of :func:`fairseq2.nn.functional.cross_entropy`
(``pad_idx``, ``target_mask``, ``reduction``, ``label_smoothing``), which each
chunk calls. Targets equal to ``pad_idx`` never count; a model that must learn
to predict its pad token (pretraining, where the end-of-document token
``<|endoftext|>`` is also Qwen3.5's pad token) must be built with
``pad_idx=None``.
"""

from __future__ import annotations

from functools import partial
from types import MethodType
from typing import Any, Final, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import ColumnShardedLinear, Linear, Projection, TiedProjection
from fairseq2.nn.functional import cross_entropy

DEFAULT_LOSS_CHUNK_SIZE: Final = 1024
"""
The default number of tokens per chunk: the fp32 log-probabilities of a chunk
take ``chunk_size * vocab_size * 4`` bytes (1 GiB with Qwen3.5's vocabulary).
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
    over chunks of ``chunk_size`` tokens.

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

    if reduction != "none" and torch.is_grad_enabled():
        proj_params = _get_plain_projection_params(final_proj)

        if proj_params is not None:
            weight, bias = proj_params

            loss: Tensor = _FusedLinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
                flat_output,
                weight,
                bias,
                flat_targets,
                _get_target_weights(flat_targets, pad_idx, flat_mask),
                reduction == "mean",
                label_smoothing,
                chunk_size,
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

    if isinstance(proj, TiedProjection | Linear | ColumnShardedLinear):
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
    """Computes ``sum_i w_i CE(x_i W^T + b, t_i)`` (or its mean over the counted
    targets) and, in the same pass over the chunks of tokens, its gradients
    with respect to ``x``, ``W`` and ``b``.

    With label smoothing ``e`` and ``V`` classes, the loss of a token is
    ``(1 - e - e') nll + e' smooth`` with ``e' = e / (V - 1)``, ``nll = lse -
    z_t`` and ``smooth = V lse - sum_j z_j``, as in
    :func:`fairseq2.nn.functional.cross_entropy`; its gradient with respect to
    the logits is ``(1 - e - e' + e' V) p - (1 - e - e') onehot(t) - e'``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        inputs: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        target_weights: Tensor,
        mean: bool,
        label_smoothing: float,
        chunk_size: int,
    ) -> Tensor:
        num_classes = weight.size(0)

        smoothing = label_smoothing / (num_classes - 1) if label_smoothing > 0.0 else 0.0

        nll_coeff = 1.0 - label_smoothing - smoothing

        # The coefficient of the softmax in the gradient of the logits.
        softmax_coeff = nll_coeff + smoothing * num_classes

        scale = 1.0

        if mean:
            num_targets = target_weights.sum().item()

            # As in `cross_entropy`, the mean of no target is NaN.
            scale = 1.0 / num_targets if num_targets > 0 else float("nan")

        need_input_grad = inputs.requires_grad
        need_weight_grad = weight.requires_grad
        need_bias_grad = bias is not None and bias.requires_grad

        input_grad = torch.empty_like(inputs) if need_input_grad else None

        weight_grad = torch.zeros_like(weight, dtype=torch.float32) if need_weight_grad else None

        bias_grad = torch.zeros_like(bias, dtype=torch.float32) if need_bias_grad else None  # type: ignore[arg-type]

        loss = inputs.new_zeros((), dtype=torch.float32)

        for begin in range(0, targets.size(0), chunk_size):
            end = begin + chunk_size

            chunk_inputs = inputs[begin:end]
            chunk_targets = targets[begin:end]

            # The counted targets, scaled for `mean`. *Shape:* (C, 1)
            chunk_weights = target_weights[begin:end].unsqueeze(-1) * scale

            logits = F.linear(chunk_inputs, weight, bias)

            compute_dtype = logits.dtype

            # For numerical stability, the softmax runs in fp32, in place.
            logits = logits.float()

            lse = torch.logsumexp(logits, dim=-1, keepdim=True)

            target_logits = logits.gather(-1, chunk_targets.unsqueeze(-1))

            token_loss = nll_coeff * (lse - target_logits)

            if smoothing > 0.0:
                token_loss = token_loss + smoothing * (num_classes * lse - logits.sum(-1, keepdim=True))

            loss += (token_loss * chunk_weights).sum()

            if input_grad is None and weight_grad is None and bias_grad is None:
                continue

            # The gradient of the chunk's loss with respect to its logits.
            grad = logits.sub_(lse).exp_().mul_(softmax_coeff)

            grad.scatter_add_(
                -1, chunk_targets.unsqueeze(-1), grad.new_full(target_logits.shape, -nll_coeff)
            )

            if smoothing > 0.0:
                grad.sub_(smoothing)

            grad.mul_(chunk_weights)

            if bias_grad is not None:
                bias_grad += grad.sum(0)

            # The gradients run in the dtype of the forward projection.
            grad = grad.to(compute_dtype)

            if input_grad is not None:
                input_grad[begin:end] = grad @ weight.to(compute_dtype)

            if weight_grad is not None:
                weight_grad += grad.t() @ chunk_inputs.to(compute_dtype)

            del grad, logits

        ctx.save_for_backward(
            input_grad,
            None if weight_grad is None else weight_grad.to(weight.dtype),
            None if bias_grad is None else bias_grad.to(bias.dtype),  # type: ignore[union-attr]
        )

        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input_grad, weight_grad, bias_grad = ctx.saved_tensors

        def scale(grad: Tensor | None) -> Tensor | None:
            return None if grad is None else grad * grad_output.to(grad.dtype)

        return scale(input_grad), scale(weight_grad), scale(bias_grad), None, None, None, None, None


def _count_loss_targets(
    targets: Tensor, pad_idx: int | None, target_mask: Tensor | None
) -> Tensor:
    """Returns the denominator of ``reduction='mean'``, as
    :func:`cross_entropy` counts it."""
    if pad_idx is None:
        if target_mask is None:
            return torch.tensor(targets.numel(), device=targets.device)

        return target_mask.sum()

    counted = targets.ne(pad_idx)

    if target_mask is not None:
        counted = counted & target_mask

    return counted.sum()


def install_chunked_lm_loss(
    model: TransformerLM, *, chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
) -> TransformerLM:
    """Makes ``model(seqs, layout, targets, ...)`` compute its loss with
    :func:`chunked_cross_entropy`, and returns ``model``.

    :class:`TransformerLM` is final, so its ``compute_fused_loss`` is replaced
    on the instance, as fairseq2's own ``compile_loss`` does.
    """
    loss_fn = partial(_compute_chunked_fused_loss, chunk_size=chunk_size)

    model.compute_fused_loss = MethodType(loss_fn, model)  # type: ignore[method-assign]

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
) -> Tensor:
    return chunked_cross_entropy(
        decoder_output,
        model.final_proj,
        targets,
        model.pad_idx,
        label_smoothing=label_smoothing,
        target_mask=target_mask,
        reduction=reduction,
        chunk_size=chunk_size,
    )
