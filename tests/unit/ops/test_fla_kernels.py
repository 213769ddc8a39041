"""The ``fla`` backend against the ``torch`` one: on CUDA, or, without a GPU,
on the CPU under Triton's interpreter (fp32 and small shapes there; see
``tests/fla_interpreter.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from fla_interpreter import fla_test_device
from qwen35_fs2.ops import causal_conv1d, gated_delta_rule, gated_rms_norm, resolve_gdn_backend
from qwen35_fs2.ops import fla_ops
from qwen35_fs2.ops.backend import fla_unavailable_reason
from qwen35_fs2.ops.varlen import VarlenMetadata

from .helpers import DeltaRuleInputs, assert_close, cu_seqlens_of, make_delta_rule_inputs

DEVICE = fla_test_device()

ON_CUDA = DEVICE is not None and DEVICE.type == "cuda"

pytestmark = [
    pytest.mark.skipif(DEVICE is None, reason="the fla kernels need a CUDA device or Triton's interpreter"),
    # `pytest -m cuda` selects them on a GPU machine.
    *([pytest.mark.cuda] if ON_CUDA else []),
    # The interpreter also evaluates masked-out lanes, which may overflow.
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]

# Per-tensor RMS error ratios of fla against our fp32 kernel, those of fla's
# own tests (`tests/ops/test_gdn.py`), 3x for bf16 inputs: on CUDA fla rounds
# its intra-chunk products (to bf16, or tf32 for fp32 inputs) and we do not.
# Under the interpreter both compute in fp32 and agree to 1e-6. Misuse of
# fla's API (argument order, grouped heads, offsets) gives errors of order 1.
TOLERANCES = {
    "o": 5e-3,
    "ht": 5e-3,
    "dq": 8e-3,
    "dk": 8e-3,
    "dv": 8e-3,
    "dg": 2e-2,
    "dbeta": 2e-2,
    "dh0": 8e-3,
}

INTERPRETER_RATIO = 1e-4

# (B, T, H, HV, K, V): the GPU runs the released head size (64 here, 128 in
# the layer tests), the interpreter (one Python program at a time) tiny ones.
PADDED_SHAPE = (2, 500, 2, 4, 64, 64) if ON_CUDA else (2, 130, 2, 4, 16, 16)

PACKED_LENGTHS = [1, 63, 64, 65, 300, 7] if ON_CUDA else [1, 63, 64, 65, 7]

DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]

DTYPE_IDS = ["fp32", "bf16"] if ON_CUDA else ["fp32"]


@pytest.fixture(autouse=True)
def require_fla() -> None:
    reason = fla_unavailable_reason()

    if reason is not None:
        pytest.skip(f"the fla backend is unavailable: {reason}")


def tolerance(name: str, dtype: torch.dtype) -> float:
    if not ON_CUDA:
        return INTERPRETER_RATIO

    return TOLERANCES[name] * (1 if dtype == torch.float32 else 3)


def run_with_grads(
    backend: str,
    inputs: DeltaRuleInputs,
    initial_state: Tensor,
    do: Tensor,
    dht: Tensor,
    *,
    kernel: Callable[..., tuple[Tensor, Tensor | None]] = gated_delta_rule,
    **kwargs: object,
) -> dict[str, Tensor]:
    leaves = inputs.leaves()

    h0 = initial_state.detach().clone().requires_grad_()

    o, ht = kernel(
        *leaves.tensors(), backend=backend, initial_state=h0, output_final_state=True, **kwargs  # type: ignore[arg-type]
    )

    assert ht is not None

    torch.autograd.backward([o, ht], [do, dht])

    grads = {f"d{name}": getattr(leaves, name).grad for name in ("q", "k", "v", "g", "beta")}

    return {"o": o, "ht": ht, **grads, "dh0": h0.grad}


def to_device(inputs: DeltaRuleInputs, dtype: torch.dtype) -> DeltaRuleInputs:
    # `g` stays fp32, as the model makes it.
    q, k, v, g, beta = inputs.tensors()

    return DeltaRuleInputs(
        q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), g.to(DEVICE), beta.to(DEVICE, dtype)
    )


class TestFlaBackend:
    def test_is_resolved_for_the_device(self) -> None:
        assert DEVICE is not None

        assert resolve_gdn_backend("fla", DEVICE) == "fla"

        # `auto` takes fla on CUDA only, never under the interpreter.
        assert resolve_gdn_backend("auto", DEVICE) == ("fla" if ON_CUDA else "torch")

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    @pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
    def test_gated_delta_rule_matches_torch_backend(self, packed: bool, dtype: torch.dtype) -> None:
        batch_size, seq_len, num_heads, num_v_heads, key_dim, value_dim = PADDED_SHAPE

        if packed:
            batch_size, seq_len = 1, sum(PACKED_LENGTHS)

        num_seqs = len(PACKED_LENGTHS) if packed else batch_size

        inputs = to_device(
            make_delta_rule_inputs(batch_size, seq_len, num_heads, num_v_heads, key_dim, value_dim, max_decay=16.0, seed=50),
            dtype,
        )

        gen = torch.Generator().manual_seed(51)

        h0 = torch.randn(num_seqs, num_v_heads, key_dim, value_dim, generator=gen).to(DEVICE)
        do = torch.randn(batch_size, seq_len, num_v_heads, value_dim, generator=gen).to(DEVICE, dtype)
        dht = torch.randn(num_seqs, num_v_heads, key_dim, value_dim, generator=gen).to(DEVICE)

        cu_seqlens = cu_seqlens_of(PACKED_LENGTHS).to(DEVICE) if packed else None

        expected = run_with_grads("torch", inputs, h0, do, dht, cu_seqlens=cu_seqlens)

        actual = run_with_grads("fla", inputs, h0, do, dht, cu_seqlens=cu_seqlens)

        assert actual["o"].dtype == dtype
        assert actual["ht"].dtype == torch.float32

        for name in TOLERANCES:
            assert_close(name, expected[name], actual[name], tolerance(name, dtype))

    @pytest.mark.parametrize("packed", [False, True], ids=["batch-3", "packed-3"])
    def test_decoding_one_token_matches_torch_backend(self, packed: bool) -> None:
        # fla's fused recurrent kernel, with states of 3 sequences.
        dtype = torch.bfloat16 if ON_CUDA else torch.float32

        batch_size, seq_len = (1, 3) if packed else (3, 1)

        inputs = to_device(make_delta_rule_inputs(batch_size, seq_len, 2, 4, 64, 64, seed=52), dtype)

        h0 = torch.randn(3, 4, 64, 64, generator=torch.Generator().manual_seed(53)).to(DEVICE)

        cu_seqlens = cu_seqlens_of([1, 1, 1]).to(DEVICE) if packed else None

        with torch.no_grad():
            expected_o, expected_ht = gated_delta_rule(
                *inputs.tensors(), backend="torch", initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens
            )

            o, ht = gated_delta_rule(
                *inputs.tensors(), backend="fla", initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens
            )

        assert_close("o", expected_o, o, 1e-2 if ON_CUDA else INTERPRETER_RATIO)
        assert_close("ht", expected_ht, ht, 5e-3 if ON_CUDA else INTERPRETER_RATIO)

    @pytest.mark.parametrize("with_states", [False, True], ids=["stateless", "with-states"])
    @pytest.mark.parametrize("lengths", [None, [1, 3, 4, 200, 2]], ids=["B2-T300", "packed-1-3-4-200-2"])
    def test_causal_conv1d_matches_torch_backend(self, lengths: list[int] | None, with_states: bool) -> None:
        batch_size, seq_len = (2, 300) if lengths is None else (1, sum(lengths))

        num_seqs = batch_size if lengths is None else len(lengths)

        dim = 384 if ON_CUDA else 48

        gen = torch.Generator().manual_seed(53)

        x = torch.randn(batch_size, seq_len, dim, generator=gen).to(DEVICE)
        weight = torch.randn(dim, 4, generator=gen).to(DEVICE)
        h0 = torch.randn(num_seqs, dim, 3, generator=gen).to(DEVICE) if with_states else None
        dy = torch.randn(batch_size, seq_len, dim, generator=gen).to(DEVICE)
        dht = torch.randn(num_seqs, dim, 3, generator=gen).to(DEVICE)

        cu_seqlens = None if lengths is None else cu_seqlens_of(lengths).to(DEVICE)

        results = {}

        for backend in ("torch", "fla"):
            leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, h0)]

            y, ht = causal_conv1d(
                leaves[0],  # type: ignore[arg-type]
                leaves[1],  # type: ignore[arg-type]
                initial_state=leaves[2],
                output_final_state=with_states,
                cu_seqlens=cu_seqlens,
                backend=backend,
            )

            outputs, cotangents = [y], [dy]

            if ht is not None:
                outputs.append(ht)
                cotangents.append(dht)

            torch.autograd.backward(outputs, cotangents)

            results[backend] = {"y": y, "ht": ht, "dx": leaves[0].grad, "dweight": leaves[1].grad}  # type: ignore[union-attr]

            if with_states:
                results[backend]["dh0"] = leaves[2].grad  # type: ignore[union-attr]

        for name, expected in results["torch"].items():
            if expected is not None:
                assert_close(name, expected, results["fla"][name], 1e-5)

    @pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
    def test_gated_rms_norm_matches_torch_backend(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(54)

        dim = 128 if ON_CUDA else 32

        x = torch.randn(2, 50, 4, dim, generator=gen).to(DEVICE, dtype).requires_grad_()
        gate = torch.randn(2, 50, 4, dim, generator=gen).to(DEVICE, dtype).requires_grad_()
        weight = (torch.rand(dim, generator=gen) + 0.5).to(DEVICE, dtype).requires_grad_()
        dy = torch.randn(2, 50, 4, dim, generator=gen).to(DEVICE, dtype)

        results = {}

        for backend in ("torch", "fla"):
            leaves = [t.detach().clone().requires_grad_() for t in (x, gate, weight)]

            y = gated_rms_norm(leaves[0], leaves[1], leaves[2], 1e-6, backend=backend)

            torch.autograd.backward([y], [dy])

            results[backend] = {"y": y, "dx": leaves[0].grad, "dgate": leaves[1].grad, "dweight": leaves[2].grad}

        # fla keeps fp32 where the reference rounds to the input dtype once.
        ratio = 1e-5 if dtype == torch.float32 else 1e-2

        for name, expected in results["torch"].items():
            assert_close(name, expected, results["fla"][name], ratio)


# Compiled and eager runs of the same fla kernels: equal under the
# interpreter; on CUDA, fla's backward accumulates some gradients with
# atomics.
COMPILED_RATIO = 1e-3 if ON_CUDA else 1e-6

# Opcheck runs each operator a dozen times: the interpreter runs one chunk.
OPCHECK_LENGTHS = [5, 15]


class TestFlaOperators:
    """fla's kernels as the ``qwen35_fs2`` custom operators that the wrappers
    run under ``torch.compile``."""

    @pytest.mark.slow
    def test_compiled_gated_delta_rule_matches_eager(self) -> None:
        # Packed, with initial and final states: every input and output of
        # the operators.
        lengths = [3, 70, 7]

        inputs = to_device(make_delta_rule_inputs(1, sum(lengths), 2, 4, 16, 16, max_decay=16.0, seed=60), torch.float32)

        gen = torch.Generator().manual_seed(61)

        h0 = torch.randn(len(lengths), 4, 16, 16, generator=gen).to(DEVICE)
        do = torch.randn(1, sum(lengths), 4, 16, generator=gen).to(DEVICE)
        dht = torch.randn(len(lengths), 4, 16, 16, generator=gen).to(DEVICE)

        assert DEVICE is not None

        varlen = VarlenMetadata(cu_seqlens_of(lengths).tolist(), DEVICE)

        expected = run_with_grads("fla", inputs, h0, do, dht, cu_seqlens=varlen)

        torch._dynamo.reset()

        compiled = torch.compile(gated_delta_rule, backend="aot_eager", fullgraph=True)

        actual = run_with_grads("fla", inputs, h0, do, dht, kernel=compiled, cu_seqlens=varlen)

        for name, value in expected.items():
            assert_close(name, value, actual[name], COMPILED_RATIO)

    @pytest.mark.slow
    @pytest.mark.parametrize("with_states", [False, True], ids=["stateless", "with-states"])
    def test_compiled_causal_conv1d_matches_eager(self, with_states: bool) -> None:
        lengths = [1, 3, 4, 40, 2]

        assert DEVICE is not None

        varlen = VarlenMetadata(cu_seqlens_of(lengths).tolist(), DEVICE)

        gen = torch.Generator().manual_seed(62)

        x = torch.randn(1, sum(lengths), 24, generator=gen).to(DEVICE)
        weight = torch.randn(24, 4, generator=gen).to(DEVICE)
        h0 = torch.randn(len(lengths), 24, 3, generator=gen).to(DEVICE) if with_states else None
        dy = torch.randn(1, sum(lengths), 24, generator=gen).to(DEVICE)
        dht = torch.randn(len(lengths), 24, 3, generator=gen).to(DEVICE)

        def conv(x: Tensor, weight: Tensor, h0: Tensor | None) -> tuple[Tensor, Tensor | None]:
            return causal_conv1d(
                x, weight, initial_state=h0, output_final_state=with_states, cu_seqlens=varlen, backend="fla"
            )

        torch._dynamo.reset()

        results = []

        for kernel in (conv, torch.compile(conv, backend="aot_eager", fullgraph=True)):
            leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, weight, h0)]

            y, ht = kernel(*leaves)  # type: ignore[arg-type]

            assert (ht is not None) == with_states

            torch.autograd.backward([y] if ht is None else [y, ht], [dy] if ht is None else [dy, dht])

            results.append({"y": y, "ht": ht, **{f"d{i}": t.grad for i, t in enumerate(leaves) if t is not None}})

        for name, expected in results[0].items():
            if expected is not None:
                assert_close(name, expected, results[1][name], COMPILED_RATIO)

    @pytest.mark.slow
    @pytest.mark.parametrize("packed", [False, True], ids=["batch-2", "packed-with-states"])
    def test_gated_delta_rule_operator_passes_opcheck(self, packed: bool) -> None:
        lengths = OPCHECK_LENGTHS

        batch_size, seq_len = (1, sum(lengths)) if packed else (len(lengths), max(lengths))

        inputs = to_device(make_delta_rule_inputs(batch_size, seq_len, 1, 2, 16, 16, seed=63), torch.float32).leaves()

        assert DEVICE is not None

        if packed:
            varlen = VarlenMetadata(cu_seqlens_of(lengths).tolist(), DEVICE)

            h0 = torch.randn(len(lengths), 2, 16, 16, device=DEVICE, requires_grad=True)

            args = (*inputs.tensors(), h0, varlen.cu_seqlens, varlen.cu_seqlens_cpu, 0.25, True, True)
        else:
            args = (*inputs.tensors(), None, None, None, 0.25, False, True)

        torch.library.opcheck(fla_ops.fla_chunk_gated_delta_rule, args)

    @pytest.mark.slow
    @pytest.mark.parametrize("packed", [False, True], ids=["batch-2", "packed-with-states"])
    def test_causal_conv1d_operator_passes_opcheck(self, packed: bool) -> None:
        lengths = OPCHECK_LENGTHS

        batch_size, seq_len = (1, sum(lengths)) if packed else (len(lengths), max(lengths))

        x = torch.randn(batch_size, seq_len, 24, device=DEVICE, requires_grad=True)
        weight = torch.randn(24, 4, device=DEVICE, requires_grad=True)

        if packed:
            assert DEVICE is not None

            varlen = VarlenMetadata(cu_seqlens_of(lengths).tolist(), DEVICE)

            # fla's states hold W inputs.
            h0 = torch.randn(len(lengths), 24, 4, device=DEVICE, requires_grad=True)

            args = (x, weight, h0, varlen.cu_seqlens, varlen.cu_seqlens_cpu, "silu", True)
        else:
            args = (x, weight, None, None, None, "silu", False)

        torch.library.opcheck(fla_ops.fla_causal_conv1d, args)

    def test_gated_rms_norm_operator_passes_opcheck(self) -> None:
        x = torch.randn(2, 7, 4, 16, device=DEVICE, requires_grad=True)
        gate = torch.randn(2, 7, 4, 16, device=DEVICE, requires_grad=True)
        weight = torch.rand(16, device=DEVICE, requires_grad=True)

        torch.library.opcheck(fla_ops.fla_gated_rms_norm, (x, gate, weight, 1e-6))

    def test_operators_reject_offsets_that_do_not_cover_the_tokens(self) -> None:
        # Under `torch.compile` their callers do not read the lengths: the
        # operators check them.
        assert DEVICE is not None

        x = torch.randn(1, 10, 24, device=DEVICE)

        offsets = torch.tensor([0, 4, 9])

        match = r"`cu_seqlens` must start at 0 and end at the sequence length T=10, but ends at 9 instead"

        with pytest.raises(ValueError, match=match):
            fla_ops.fla_causal_conv1d(x, torch.randn(24, 4, device=DEVICE), None, offsets.to(DEVICE), offsets, "silu", False)

        q, k = torch.randn(1, 10, 2, 16, device=DEVICE), torch.randn(1, 10, 2, 16, device=DEVICE)

        v, g, beta = torch.randn(1, 10, 2, 16, device=DEVICE), -torch.rand(1, 10, 2, device=DEVICE), torch.rand(1, 10, 2, device=DEVICE)

        with pytest.raises(ValueError, match=match):
            fla_ops.fla_chunk_gated_delta_rule(q, k, v, g, beta, None, offsets.to(DEVICE), offsets, 0.25, False, True)
