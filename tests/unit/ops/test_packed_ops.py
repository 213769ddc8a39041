"""The PyTorch kernels of packed batches as custom operators (what runs
under ``torch.compile``): their registrations pass ``torch.library.opcheck``
(schema, fake implementation, autograd, dynamic shapes), and they compute
what the eager kernels compute, forward and backward.

The eager kernels are tested against the naive recurrence and transformers
elsewhere (``test_delta_rule.py``, ``test_causal_conv.py``); here, in fp64,
the operators must agree with them to rounding."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from qwen35_fs2.ops.causal_conv import causal_conv1d
from qwen35_fs2.ops.delta_rule.chunk import chunk_gated_delta_rule
from qwen35_fs2.ops.packed_ops import packed_causal_conv1d, packed_chunk_gated_delta_rule
from qwen35_fs2.ops.varlen import VarlenMetadata

# Documents across chunk boundaries (chunk size 16 below), one of a single
# token and one empty.
_LENGTHS = [20, 1, 33, 0, 16, 9]

_NUM_TOKENS = sum(_LENGTHS)

_CHUNK_SIZE = 16


def _offsets() -> Tensor:
    return torch.tensor([0, *torch.tensor(_LENGTHS).cumsum(0).tolist()])


def _delta_rule_inputs(initial_state: bool) -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_()

    # 2 query/key heads, 4 value heads; decays from -2 to 0.
    q, k, v = randn(1, _NUM_TOKENS, 2, 8), randn(1, _NUM_TOKENS, 2, 8), randn(1, _NUM_TOKENS, 4, 8)

    g = (-2.0 * torch.rand((1, _NUM_TOKENS, 4), generator=generator, dtype=torch.float64)).requires_grad_()

    beta = torch.rand((1, _NUM_TOKENS, 4), generator=generator, dtype=torch.float64).requires_grad_()

    inputs = [q, k, v, g, beta]

    if initial_state:
        inputs.append(randn(len(_LENGTHS), 4, 8, 8))

    return inputs


def _grads(outputs: tuple[Tensor, ...], inputs: list[Tensor]) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)

    loss = sum((out * torch.randn(out.shape, generator=generator, dtype=out.dtype)).sum() for out in outputs)

    return list(torch.autograd.grad(loss, inputs))


def _assert_close(expected: list[Tensor], actual: list[Tensor]) -> None:
    assert len(expected) == len(actual)

    for idx, (e, a) in enumerate(zip(expected, actual)):
        assert a.shape == e.shape, idx

        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=f"tensor {idx}")


@pytest.mark.parametrize("initial_state", [False, True])
def test_delta_rule_operator_computes_what_the_eager_kernel_does(initial_state: bool) -> None:
    inputs = _delta_rule_inputs(initial_state)

    q, k, v, g, beta, *state = inputs

    h0 = state[0] if state else None

    o, ht = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True,
        cu_seqlens=VarlenMetadata(_offsets().tolist(), q.device), chunk_size=_CHUNK_SIZE,
    )  # fmt: skip

    assert ht is not None

    op_o, op_ht, _, _, _ = packed_chunk_gated_delta_rule(
        q, k, v, g, beta, h0, _offsets(), 8**-0.5, True, True, _CHUNK_SIZE
    )

    _assert_close([o, ht], [op_o, op_ht])

    _assert_close(_grads((o, ht), inputs), _grads((op_o, op_ht), inputs))


@pytest.mark.parametrize("initial_state", [False, True])
def test_convolution_operator_computes_what_the_eager_kernel_does(initial_state: bool) -> None:
    generator = torch.Generator().manual_seed(0)

    x = torch.randn((1, _NUM_TOKENS, 6), generator=generator, dtype=torch.float64).requires_grad_()

    weight = torch.randn((6, 4), generator=generator, dtype=torch.float64).requires_grad_()

    inputs = [x, weight]

    h0 = None

    if initial_state:
        h0 = torch.randn((len(_LENGTHS), 6, 3), generator=generator, dtype=torch.float64).requires_grad_()

        inputs.append(h0)

    y, ht = causal_conv1d(
        x, weight, initial_state=h0, output_final_state=True, cu_seqlens=VarlenMetadata(_offsets().tolist(), x.device)
    )

    assert ht is not None

    op_y, op_ht = packed_causal_conv1d(x, weight, h0, _offsets(), True, True)

    _assert_close([y, ht], [op_y, op_ht])

    _assert_close(_grads((y, ht), inputs), _grads((op_y, op_ht), inputs))


def _opcheck(op: Callable[..., object], args: tuple[object, ...]) -> None:
    # Raises on a wrong schema, fake implementation or autograd registration,
    # and on a failure under AOTAutograd with dynamic shapes.
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("initial_state", [False, True])
def test_delta_rule_operator_passes_opcheck(initial_state: bool) -> None:
    q, k, v, g, beta, *state = _delta_rule_inputs(initial_state)

    h0 = state[0] if state else None

    _opcheck(
        torch.ops.qwen35_fs2.packed_chunk_gated_delta_rule.default,
        (q, k, v, g, beta, h0, _offsets(), 8**-0.5, True, initial_state, _CHUNK_SIZE),
    )


@pytest.mark.parametrize("initial_state", [False, True])
def test_convolution_operator_passes_opcheck(initial_state: bool) -> None:
    x = torch.randn((1, _NUM_TOKENS, 6), dtype=torch.float64, requires_grad=True)

    weight = torch.randn((6, 4), dtype=torch.float64, requires_grad=True)

    h0 = torch.randn((len(_LENGTHS), 6, 3), dtype=torch.float64, requires_grad=True) if initial_state else None

    _opcheck(torch.ops.qwen35_fs2.packed_causal_conv1d.default, (x, weight, h0, _offsets(), True, initial_state))


def test_delta_rule_operator_rejects_offsets_that_do_not_cover_the_tokens() -> None:
    q, k, v, g, beta = _delta_rule_inputs(False)

    offsets = _offsets()

    offsets[-1] -= 1

    with pytest.raises(ValueError, match=r"`cu_seqlens` must start at 0 and end at the sequence length T="):
        packed_chunk_gated_delta_rule(q, k, v, g, beta, None, offsets, 1.0, True, False, _CHUNK_SIZE)


def test_operators_under_bf16_autocast_compute_what_the_eager_kernels_do() -> None:
    # The regime of mixed-precision training on one device: bf16
    # activations under autocast. Both paths run the same autocast-free
    # kernels, so they agree exactly, gradients included.
    q, k, v, g, beta = (t.detach().to(torch.bfloat16).requires_grad_() for t in _delta_rule_inputs(False))

    inputs = [q, k, v, g, beta]

    varlen = VarlenMetadata(_offsets().tolist(), q.device)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=varlen, chunk_size=_CHUNK_SIZE)

        op_o, _, _, _, _ = packed_chunk_gated_delta_rule(
            q, k, v, g, beta, None, _offsets(), 8**-0.5, True, False, _CHUNK_SIZE
        )

    assert op_o.dtype == o.dtype == torch.bfloat16

    torch.testing.assert_close(op_o, o, rtol=0, atol=0)

    for expected, actual in zip(_grads((o,), inputs), _grads((op_o,), inputs)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)

    x = torch.randn((1, _NUM_TOKENS, 6), dtype=torch.bfloat16, requires_grad=True)

    weight = torch.randn((6, 4), requires_grad=True)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = causal_conv1d(x, weight, cu_seqlens=varlen)

        op_y, _ = packed_causal_conv1d(x, weight, None, _offsets(), True, False)

    torch.testing.assert_close(op_y, y, rtol=0, atol=0)

    for expected, actual in zip(_grads((y,), [x, weight]), _grads((op_y,), [x, weight])):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
