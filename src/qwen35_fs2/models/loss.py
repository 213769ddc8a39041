"""A language-model loss that never materialises the logits of a whole batch.

With Qwen3.5's 248,320-entry vocabulary, fairseq2's
:meth:`TransformerLM.compute_fused_loss` holds the logits and their fp32
log-probabilities for every token of the batch at once: 16k tokens take about
16 GB for the log-probabilities alone. Here the final projection and the cross
entropy run over chunks of tokens; each chunk is checkpointed, so its logits
are freed after the forward pass and recomputed, one chunk at a time, in the
backward pass. Peak memory is one chunk's logits instead of the batch's.

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
from typing import Final, Literal

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import Projection
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
    if chunk_size < 1:
        raise ValueError(
            f"`chunk_size` must be greater than or equal to 1, but is {chunk_size} instead."
        )

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
