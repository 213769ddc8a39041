"""Inputs and comparisons shared by the tests of the Gated DeltaNet kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class DeltaRuleInputs:
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self.q, self.k, self.v, self.g, self.beta

    def leaves(self) -> DeltaRuleInputs:
        """Returns detached copies that require gradients."""
        return DeltaRuleInputs(*(t.detach().clone().requires_grad_() for t in self.tensors()))


def make_delta_rule_inputs(
    batch_size: int,
    seq_len: int,
    num_heads: int,
    num_v_heads: int,
    key_dim: int,
    value_dim: int,
    *,
    max_decay: float = 1.0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> DeltaRuleInputs:
    """Draws inputs as a Qwen3.5 layer makes them: ``beta = sigmoid(b)`` and
    ``g = -A * softplus(a + 1)`` with ``A ~ U(0.01, max_decay)`` per value
    head (the released models draw ``A`` up to 16)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = randn(batch_size, seq_len, num_heads, key_dim)
    k = randn(batch_size, seq_len, num_heads, key_dim)
    v = randn(batch_size, seq_len, num_v_heads, value_dim)

    beta = randn(batch_size, seq_len, num_v_heads).sigmoid()

    decay_rate = torch.empty(num_v_heads, dtype=torch.float64).uniform_(0.01, max_decay, generator=gen)

    g = -decay_rate * F.softplus(randn(batch_size, seq_len, num_v_heads) + 1.0)

    return DeltaRuleInputs(q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype))


def assert_close(name: str, expected: Tensor | None, actual: Tensor | None, ratio: float) -> None:
    """Asserts ``rms(actual - expected) <= ratio * rms(expected)``, as fla's
    tests do, and that ``actual`` is finite."""
    assert expected is not None and actual is not None, f"{name}: missing"

    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"

    if expected.numel() == 0:
        return

    actual, expected = actual.detach().double(), expected.detach().double()

    assert torch.isfinite(actual).all(), f"{name}: has NaN or Inf values"

    diff = (actual - expected).abs()

    error = diff.pow(2).mean().sqrt().item()
    scale = expected.pow(2).mean().sqrt().item()

    assert error <= ratio * scale, (
        f"{name}: RMS error ratio {error / max(scale, 1e-30):.3g} > {ratio:.3g} (max abs diff {diff.max().item():.3g}, RMS of expected {scale:.3g})"
    )


def random_lengths(total: int, seed: int, must_include: tuple[int, ...] = ()) -> list[int]:
    """Splits ``total`` into document lengths that start with ``must_include``
    and continue with random lengths."""
    gen = torch.Generator().manual_seed(seed)

    lengths = list(must_include)

    remaining = total - sum(lengths)

    if remaining < 0:
        raise ValueError(f"`total` must be at least {sum(lengths)}, but is {total} instead.")

    while remaining > 0:
        length = int(torch.randint(1, min(remaining, 150) + 1, (1,), generator=gen))

        lengths.append(length)

        remaining -= length

    return lengths


def cu_seqlens_of(lengths: list[int], dtype: torch.dtype = torch.int32) -> Tensor:
    offsets = [0]

    for length in lengths:
        offsets.append(offsets[-1] + length)

    return torch.tensor(offsets, dtype=dtype)
