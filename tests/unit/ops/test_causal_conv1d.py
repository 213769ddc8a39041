"""The depthwise causal convolution of the Gated DeltaNet layers."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from qwen35_fs2.ops import causal_conv1d
from qwen35_fs2.ops.causal_conv import conv_taps

from .helpers import assert_close, cu_seqlens_of, random_lengths


def reference_conv(x: Tensor, weight: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
    """One sequence ``[T, D]`` through ``torch.nn.functional.conv1d`` and
    SiLU, preceded by ``state`` ``[D, W - 1]`` (zeros if ``None``); returns the
    output and the last ``W - 1`` inputs."""
    dim, width = weight.shape

    if state is None:
        state = x.new_zeros(dim, width - 1)

    history = torch.cat([state, x.T], dim=1)

    y = F.conv1d(history[None], weight[:, None, :], groups=dim)[0].T

    return F.silu(y), history[:, history.size(1) - (width - 1) :]


def run_with_grads(
    x: Tensor, weight: Tensor, initial_state: Tensor, dy: Tensor, dht: Tensor, **kwargs: object
) -> dict[str, Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, initial_state)]

    y, ht = causal_conv1d(
        leaves[0], leaves[1], initial_state=leaves[2], output_final_state=True, **kwargs  # type: ignore[arg-type]
    )

    assert ht is not None

    torch.autograd.backward([y, ht], [dy, dht])

    grads = {"dx": leaves[0].grad, "dweight": leaves[1].grad, "dh0": leaves[2].grad}

    for name, grad in grads.items():
        assert grad is not None, name

    return {"y": y, "ht": ht, **grads}  # type: ignore[dict-item]


class TestCausalConv1d:
    @pytest.mark.parametrize(
        "lengths",
        [[1, 3, 4, 5, 64], random_lengths(500, seed=30, must_include=(2, 1, 3)), [0, 7, 0]],
        ids=["edge-lengths", "random-lengths", "empty-documents"],
    )
    def test_packed_documents_match_per_document_conv1d(self, lengths: list[int]) -> None:
        gen = torch.Generator().manual_seed(31)

        total, dim, width = sum(lengths), 24, 4

        x = torch.randn(1, total, dim, generator=gen)
        weight = torch.randn(dim, width, generator=gen)
        h0 = torch.randn(len(lengths), dim, width - 1, generator=gen)
        dy = torch.randn(1, total, dim, generator=gen)
        dht = torch.randn(len(lengths), dim, width - 1, generator=gen)

        actual = run_with_grads(x, weight, h0, dy, dht, cu_seqlens=cu_seqlens_of(lengths))

        expected_dweight = torch.zeros_like(weight)

        begin = 0

        for idx, length in enumerate(lengths):
            end = begin + length

            if length == 0:
                # Nothing to convolve: the state passes through.
                assert_close(f"ht of document {idx}", h0[idx], actual["ht"][idx], 0.0)
                assert_close(f"dh0 of document {idx}", dht[idx], actual["dh0"][idx], 0.0)

                continue

            leaves = [t.detach().clone().requires_grad_() for t in (x[0, begin:end], weight, h0[idx])]

            y, ht = reference_conv(*leaves)

            torch.autograd.backward([y, ht], [dy[0, begin:end], dht[idx]])

            assert leaves[1].grad is not None

            expected_dweight += leaves[1].grad

            assert_close(f"y of document {idx}", y, actual["y"][0, begin:end], 1e-6)
            assert_close(f"ht of document {idx}", ht, actual["ht"][idx], 1e-6)

            assert_close(f"dx of document {idx}", leaves[0].grad, actual["dx"][0, begin:end], 1e-6)

            assert_close(f"dh0 of document {idx}", leaves[2].grad, actual["dh0"][idx], 1e-6)

            begin = end

        assert_close("dweight", expected_dweight, actual["dweight"], 1e-6)

    @pytest.mark.parametrize("width", [2, 4], ids=["W2", "W4"])
    def test_regular_batch_matches_conv1d_per_row(self, width: int) -> None:
        gen = torch.Generator().manual_seed(32)

        x = torch.randn(3, 50, 16, generator=gen)
        weight = torch.randn(16, width, generator=gen)
        h0 = torch.randn(3, 16, width - 1, generator=gen)
        dy = torch.randn(3, 50, 16, generator=gen)
        dht = torch.randn(3, 16, width - 1, generator=gen)

        actual = run_with_grads(x, weight, h0, dy, dht)

        packed = run_with_grads(
            x.flatten(0, 1)[None], weight, h0, dy.flatten(0, 1)[None], dht, cu_seqlens=cu_seqlens_of([50] * 3)
        )

        expected = [reference_conv(x[b], weight, h0[b]) for b in range(3)]

        assert_close("y", torch.stack([y for y, _ in expected]), actual["y"], 1e-6)
        assert_close("ht", torch.stack([ht for _, ht in expected]), actual["ht"], 1e-6)

        # A regular batch and the same rows packed take different paths.
        for name in actual:
            assert_close(f"{name} packed", actual[name], packed[name].view(actual[name].shape), 1e-6)

    @pytest.mark.parametrize("packed", [False, True], ids=["regular", "packed"])
    def test_backward_passes_gradcheck_in_float64(self, packed: bool) -> None:
        gen = torch.Generator().manual_seed(34)

        x = torch.randn(1 if packed else 2, 9, 3, generator=gen, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        h0 = torch.randn(3 if packed else 2, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)

        cu_seqlens = torch.tensor([0, 2, 2, 9]) if packed else None

        def fn(x: Tensor, weight: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
            y, ht = causal_conv1d(x, weight, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)

            assert ht is not None

            return y, ht

        assert torch.autograd.gradcheck(fn, (x, weight, h0), fast_mode=True)

    @pytest.mark.parametrize("packed", [False, True], ids=["regular", "packed"])
    def test_sums_bf16_under_autocast_in_fp32_as_the_reference_convolution(self, packed: bool) -> None:
        # The training regime: bf16 activations, an fp32 weight under
        # autocast. The reference: the same bf16 values (the weight rounded
        # as autocast rounds it) in fp64, which a convolution summing in
        # fp32 meets within the rounding of its bf16 output (relative
        # distance 1.4e-3 here); summed in bf16 it was 2.9e-3 away, its
        # weight gradient too.
        gen = torch.Generator().manual_seed(36)

        dim, seq_len, width = 512, 256, 4

        x = torch.randn(1, seq_len, dim, generator=gen).bfloat16()
        weight = 0.5 * torch.randn(dim, width, generator=gen)
        dy = torch.randn(1, seq_len, dim, generator=gen).bfloat16()

        x_ref = x.double().requires_grad_()
        weight_ref = weight.bfloat16().double().requires_grad_()

        expected, _ = reference_conv(x_ref[0], weight_ref, None)

        expected.backward(dy[0].double())

        x_bf16 = x.clone().requires_grad_()
        weight_fp32 = weight.clone().requires_grad_()

        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = causal_conv1d(x_bf16, weight_fp32, cu_seqlens=cu_seqlens_of([seq_len]) if packed else None)

        y.backward(dy)

        assert y.dtype == torch.bfloat16 and weight_fp32.grad is not None and weight_fp32.grad.dtype == torch.float32

        def distance(actual: Tensor, reference: Tensor) -> float:
            return float((actual.double() - reference).abs().sum() / reference.abs().sum())

        assert distance(y[0], expected) < 1.8e-3
        assert distance(x_bf16.grad, x_ref.grad) < 1.8e-3  # type: ignore[arg-type]
        assert distance(weight_fp32.grad, weight_ref.grad) < 1e-6  # type: ignore[arg-type]

    def test_no_activation_is_the_plain_convolution(self) -> None:
        x, weight = torch.randn(1, 20, 8), torch.randn(8, 4)

        y, _ = causal_conv1d(x, weight, activation=None)

        expected = F.conv1d(F.pad(x[0].T, (3, 0))[None], weight[:, None, :], groups=8)[0].T

        assert_close("y", expected, y[0], 1e-6)

    @pytest.mark.parametrize("pieces", [[100], [40, 1, 2, 57], [1, 1, 1, 97]], ids=["100", "40-1-2-57", "1-1-1-97"])
    def test_state_carried_across_pieces_matches_one_pass(self, pieces: list[int]) -> None:
        gen = torch.Generator().manual_seed(33)

        x = torch.randn(2, 100, 16, generator=gen)
        weight = torch.randn(16, 4, generator=gen)

        expected_y, expected_ht = causal_conv1d(x, weight, output_final_state=True)

        outputs, state, begin = [], None, 0

        for length in pieces:
            y, state = causal_conv1d(
                x[:, begin : begin + length], weight, initial_state=state, output_final_state=True
            )

            outputs.append(y)

            begin += length

        assert expected_ht is not None and state is not None

        assert_close("y", expected_y, torch.cat(outputs, dim=1), 1e-6)
        assert_close("ht", expected_ht, state, 1e-6)

    def test_inputs_are_left_unchanged(self) -> None:
        x, weight, h0 = torch.randn(1, 30, 8), torch.randn(8, 4), torch.randn(2, 8, 3)

        copies = [t.clone() for t in (x, weight, h0)]

        run_with_grads(x, weight, h0, torch.ones(1, 30, 8), torch.ones(2, 8, 3), cu_seqlens=torch.tensor([0, 2, 30]))

        for name, before, after in zip(("x", "weight", "h0"), copies, (x, weight, h0)):
            assert torch.equal(before, after), f"`{name}` was modified in place"

    def test_raises_error_when_initial_state_has_wrong_shape(self) -> None:
        with pytest.raises(ValueError, match=r"`initial_state` must be of shape \[N, D, W - 1\] = \(2, 8, 3\)"):
            causal_conv1d(
                torch.randn(1, 10, 8), torch.randn(8, 4), initial_state=torch.zeros(2, 8, 4), cu_seqlens=torch.tensor([0, 5, 10])
            )

    def test_raises_error_when_weight_has_wrong_shape(self) -> None:
        with pytest.raises(ValueError, match=r"`weight` must be of shape \[D=8, W\]"):
            causal_conv1d(torch.randn(1, 10, 8), torch.randn(4, 8))

    def test_raises_error_when_cu_seqlens_is_inconsistent(self) -> None:
        with pytest.raises(ValueError, match="must start at 0 and end at the sequence length T=10"):
            causal_conv1d(torch.randn(1, 10, 8), torch.randn(8, 4), cu_seqlens=torch.tensor([0, 5, 9]))

    def test_raises_error_when_batch_size_is_not_1_with_cu_seqlens(self) -> None:
        with pytest.raises(ValueError, match="The batch size must be 1 when `cu_seqlens` is given, but is 2 instead"):
            causal_conv1d(torch.randn(2, 10, 8), torch.randn(8, 4), cu_seqlens=torch.tensor([0, 10]))

    def test_raises_error_when_activation_is_unknown(self) -> None:
        with pytest.raises(ValueError, match="`activation` must be 'silu' or `None`, but is 'relu' instead"):
            causal_conv1d(torch.randn(1, 10, 8), torch.randn(8, 4), activation="relu")  # type: ignore[arg-type]


class TestCompiledConvolution:
    """The ``[W, D]`` taps are the operator ``qwen35_fs2::conv_taps``, so
    that inductor reads them row by row."""

    @pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.float32, torch.bfloat16)])
    def test_taps_operator_passes_opcheck(self, dtypes: tuple[torch.dtype, torch.dtype]) -> None:
        weight_dtype, dtype = dtypes

        weight = torch.randn(6, 4, dtype=weight_dtype, requires_grad=True)

        # Raises on a wrong schema, fake implementation or autograd
        # registration, and on a failure under AOTAutograd.
        torch.library.opcheck(torch.ops.qwen35_fs2.conv_taps.default, (weight, dtype))

    def test_taps_operator_transposes_the_weight_and_its_gradient(self) -> None:
        weight = torch.randn(6, 4, requires_grad=True)

        taps = conv_taps(weight, torch.bfloat16)

        assert taps.dtype == torch.bfloat16

        assert torch.equal(taps, weight.detach().to(torch.bfloat16).t())

        dtaps = torch.randn(4, 6, dtype=torch.bfloat16)

        taps.backward(dtaps)

        assert weight.grad is not None and weight.grad.dtype == torch.float32

        assert torch.equal(weight.grad, dtaps.t().float())

    @pytest.mark.slow
    def test_compiled_loops_over_the_channels_are_vectorized(self) -> None:
        # Pins the inductor behaviour the operator works around: with the
        # taps as `weight.t().contiguous()`, inductor reads the weight's
        # columns with a stride of W and loops over the channels one at a
        # time in the forward pass and in the backward pass's recomputation
        # (measured with torch 2.9.1; docs/performance.md, "Ninth session").
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        from torch._inductor.utils import run_and_get_code

        if not pick_vec_isa():
            pytest.skip("inductor finds no SIMD instruction set on this CPU: every loop is scalar")

        num_channels = 64

        generator = torch.Generator().manual_seed(0)

        x = torch.randn(2, 40, num_channels, generator=generator)

        weight = torch.randn(num_channels, 4, generator=generator)

        def forward(x: Tensor, weight: Tensor) -> Tensor:
            return causal_conv1d(x, weight, activation="silu")[0]

        def grads(fn: Callable[[Tensor, Tensor], Tensor]) -> list[Tensor]:
            leaves = [t.clone().requires_grad_() for t in (x, weight)]

            y = fn(*leaves)

            y.backward(torch.ones_like(y))

            dx, dweight = (leaf.grad for leaf in leaves)

            assert dx is not None and dweight is not None

            return [y.detach(), dx, dweight]

        torch._dynamo.reset()

        compiled = torch.compile(forward, fullgraph=True)

        # Every graph compiled here, not read from a cache of an earlier run.
        with torch._inductor.config.patch(force_disable_caches=True):
            actual, codes = run_and_get_code(grads, compiled)

        for name, expected, value in zip(("y", "dx", "dweight"), grads(forward), actual):
            assert_close(name, expected, value, 1e-6)

        source = "\n".join(codes)

        assert "qwen35_fs2.conv_taps" in source

        scalar_channel_loop = re.compile(
            rf"for\(int64_t (x\d+)=static_cast<int64_t>\(0L\); \1<static_cast<int64_t>\({num_channels}L\); \1\+=static_cast<int64_t>\(1L\)\)"
        )

        assert scalar_channel_loop.search(source) is None, "a loop over the channels is not vectorized"
