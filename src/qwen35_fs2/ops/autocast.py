"""How the package's own autograd functions meet ``torch.autocast``.

One policy for every custom :class:`torch.autograd.Function` of the package
(the chunked delta rule, the causal convolution, the fused linear cross
entropy, the MoE expert GEMMs and row gathers), for the custom
operators that compute with PyTorch operations (the MoE experts under
``torch.compile``), and for the PyTorch kernel that stands in for one of
fla's (:mod:`qwen35_fs2.compat.fla_hopper_dqkwg`):

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
    ``fn(ctx, *args)``, or the implementation of a custom operator) with
    autocast disabled for the device of its first tensor argument; see the
    module docstring.

    Custom operators need it as much: the dispatcher passes them through
    autocast without disabling it, so the operations inside would be cast
    again."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tensors = (a for a in (*args, *kwargs.values()) if isinstance(a, Tensor))

        device_type = next((t.device.type for t in tensors), None)

        if device_type is None or not torch.is_autocast_enabled(device_type):
            return fn(*args, **kwargs)

        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
