"""Depthwise causal 1-D convolution that restarts at document boundaries."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from qwen35_fs2.ops.backend import GdnBackend
from qwen35_fs2.ops.fla_kernels import fla_causal_conv1d


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    *,
    activation: Literal["silu"] | None = "silu",
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    backend: GdnBackend = "torch",
) -> tuple[Tensor, Tensor | None]:
    """Convolves every channel of ``x`` with its own causal kernel.

    ``y[t] = sum_j weight[:, j] * x[t - (W - 1) + j]``, where inputs before
    the start of a sequence come from ``initial_state`` (zeros if ``None``).

    :param x: The input of shape ``[B, T, D]``.
    :param weight: The kernels of shape ``[D, W]``.
    :param activation: Applied to the output.
    :param initial_state: The ``W - 1`` inputs preceding each sequence, of
        shape ``[N, D, W - 1]``.
    :param output_final_state: If ``True``, also returns the last ``W - 1``
        inputs of each sequence (what a following call needs as its state).
    :param cu_seqlens: Cumulative document lengths ``[N + 1]`` of a packed
        batch (``B`` must be 1); the receptive field never crosses a document
        start.
    :param backend: ``fla`` runs Dao-AILab's ``causal_conv1d`` (if installed
        and no state is involved) or fla's Triton kernel; CUDA only.

    :returns: The output of shape ``[B, T, D]`` and, if requested, the final
        states of shape ``[N, D, W - 1]``.
    """
    batch_size, seq_len, dim = x.shape

    if weight.ndim != 2 or weight.size(0) != dim:
        raise ValueError(
            f"`weight` must be of shape [D={dim}, W], but is {tuple(weight.shape)} instead."
        )

    width = weight.size(1)

    if activation not in ("silu", None):
        raise ValueError(
            f"`activation` must be 'silu' or `None`, but is '{activation}' instead."
        )

    if cu_seqlens is not None and batch_size != 1:
        raise ValueError(
            f"The batch size must be 1 when `cu_seqlens` is given, but is {batch_size} instead."
        )

    num_seqs = batch_size if cu_seqlens is None else cu_seqlens.numel() - 1

    state_shape = (num_seqs, dim, width - 1)

    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(
            f"`initial_state` must be of shape [N, D, W - 1] = {state_shape}, but is {tuple(initial_state.shape)} instead."
        )

    if backend == "fla":
        return fla_causal_conv1d(
            x,
            weight,
            activation=activation,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )

    if cu_seqlens is None:
        x_flat = x.reshape(batch_size * seq_len, dim)

        offsets = torch.arange(
            0, (batch_size + 1) * seq_len, seq_len, device=x.device
        )
    else:
        x_flat = x[0]

        offsets = cu_seqlens.to(device=x.device, dtype=torch.int64)

    if initial_state is None:
        state = x.new_zeros(state_shape)
    else:
        state = initial_state.to(x.dtype)

    total_len = x_flat.size(0)

    # For each token, its sequence index and its position in the sequence.
    lengths = offsets[1:] - offsets[:-1]

    seq_ids = torch.repeat_interleave(
        torch.arange(num_seqs, device=x.device), lengths, output_size=total_len
    )

    positions = torch.arange(total_len, device=x.device) - offsets[seq_ids]

    # Rows [0, N * (W - 1)) hold the states, followed by the inputs.
    history = torch.cat([state.transpose(1, 2).reshape(-1, dim), x_flat])

    num_state_rows = num_seqs * (width - 1)

    token_rows = torch.arange(total_len, device=x.device) + num_state_rows

    y = x_flat * weight[:, width - 1]

    for shift in range(1, width):
        in_seq = positions >= shift

        # Before the sequence start, read slot `W - 1 - (shift - pos)` of
        # the sequence's state.
        state_rows = seq_ids * (width - 1) + (width - 1) - (shift - positions)

        rows = torch.where(in_seq, token_rows - shift, state_rows)

        y = y + history[rows] * weight[:, width - 1 - shift]

    if activation == "silu":
        y = F.silu(y)

    y = y.view(batch_size, seq_len, dim)

    if not output_final_state:
        return y, None

    # The last W - 1 inputs of each sequence, reaching into its state when the
    # sequence is shorter than that.
    ends = offsets[1:]

    slots = torch.arange(-(width - 1), 0, device=x.device)

    # (N, W - 1)
    last = ends[:, None] + slots[None, :]

    in_seq = last >= offsets[:-1, None]

    seq_rows = torch.arange(num_seqs, device=x.device)[:, None]

    state_rows = seq_rows * (width - 1) + (width - 1) + (last - offsets[:-1, None])

    rows = torch.where(in_seq, last + num_state_rows, state_rows)

    # (N, W - 1, D) -> (N, D, W - 1)
    final_state = history[rows].transpose(1, 2).contiguous()

    return y, final_state
