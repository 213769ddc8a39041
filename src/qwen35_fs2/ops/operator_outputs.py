"""What the package's custom operators return for an output a call does not
produce: an operator returns tensors only, so an absent final state is an
empty tensor, and so is its gradient."""

from __future__ import annotations

from torch import Tensor


def empty_output(x: Tensor) -> Tensor:
    """The placeholder of an output that a call does not produce (on the
    device and in the dtype of ``x``)."""
    return x.new_empty((0,))


def output_grad(grad: Tensor | None) -> Tensor | None:
    """The gradient of an output, ``None`` for the placeholder of an output
    that the call did not produce (or that got no gradient)."""
    return None if grad is None or grad.numel() == 0 else grad
