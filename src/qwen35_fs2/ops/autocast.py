"""How the package's own autograd functions meet ``torch.autocast``.

One policy for every custom :class:`torch.autograd.Function` of the package
(the chunked delta rule, the causal convolution, the fused linear cross
entropy, the MoE expert GEMMs and row gathers):

- Autocast never reaches inside them. Their ``forward`` and ``backward`` run
  with autocast disabled for the device of their tensors
  (:func:`autocast_free`), so the backward recomputes exactly what the
  forward computed, whether or not the caller's backward pass runs under
  autocast (on CPU it would run in the caller's thread and context).
- The autocast decision is made once, by the caller, before the function is
  applied: where autocast would run a GEMM in lower precision (the LM head,
  the MoE experts), the caller casts the operands to :func:`autocast_dtype`
  and the function computes in that dtype, accumulating in fp32 where it
  sums over many terms.
- Recurrences keep their own precision: the delta-rule state and its
  intra-chunk products are fp32 whatever the input dtype (as fla accumulates
  its state in fp32), the convolution runs in the dtype of its input, and
  outputs come back in the dtype of the input they replace (``v`` for the
  delta rule, ``x`` for the convolution).

Gradients come back in the dtype of each input, so a bf16 activation gets a
bf16 gradient and an fp32 parameter an fp32 one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

_F = TypeVar("_F", bound=Callable[..., Any])


def autocast_dtype(x: Tensor) -> torch.dtype:
    """Returns the dtype autocast would run a GEMM of ``x`` in: the autocast
    dtype when autocast is enabled for the device of ``x``, else the dtype of
    ``x``."""
    device_type = x.device.type

    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)

    return x.dtype


def autocast_free(fn: _F) -> _F:
    """Runs ``fn`` (the ``forward`` or ``backward`` of an autograd function,
    ``fn(ctx, *args)``) with autocast disabled for the device of the first
    tensor among ``args``; see the module docstring."""

    @functools.wraps(fn)
    def wrapper(ctx: Any, *args: Any) -> Any:
        device_type = next((a.device.type for a in args if isinstance(a, Tensor)), None)

        if device_type is None or not torch.is_autocast_enabled(device_type):
            return fn(ctx, *args)

        with torch.autocast(device_type, enabled=False):
            return fn(ctx, *args)

    return wrapper  # type: ignore[return-value]
