"""The ``fla`` backend against the ``torch`` one (CUDA only)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from qwen35_fs2.ops import causal_conv1d, gated_delta_rule, gated_rms_norm, resolve_gdn_backend
from qwen35_fs2.ops.backend import fla_unavailable_reason

from .helpers import DeltaRuleInputs, assert_close, cu_seqlens_of, make_delta_rule_inputs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fla kernels need a CUDA device"),
]

CUDA = torch.device("cuda")

# Per-tensor RMS error ratios of fla against our fp32 kernel, those of fla's
# own tests (`tests/ops/test_gdn.py`), 3x for bf16 inputs: fla rounds its
# intra-chunk products (to bf16, or tf32 for fp32 inputs) and we do not.
# Misuse of fla's API (argument order, grouped heads, offsets) gives errors of
# order 1.
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


@pytest.fixture(autouse=True)
def require_fla() -> None:
    reason = fla_unavailable_reason()

    if reason is not None:
        pytest.skip(f"the fla backend is unavailable: {reason}")


def run_with_grads(
    backend: str, inputs: DeltaRuleInputs, initial_state: Tensor, do: Tensor, dht: Tensor, **kwargs: object
) -> dict[str, Tensor]:
    leaves = inputs.leaves()

    h0 = initial_state.detach().clone().requires_grad_()

    o, ht = gated_delta_rule(
        *leaves.tensors(), backend=backend, initial_state=h0, output_final_state=True, **kwargs  # type: ignore[arg-type]
    )

    assert ht is not None

    torch.autograd.backward([o, ht], [do, dht])

    grads = {f"d{name}": getattr(leaves, name).grad for name in ("q", "k", "v", "g", "beta")}

    return {"o": o, "ht": ht, **grads, "dh0": h0.grad}


def to_cuda(inputs: DeltaRuleInputs, dtype: torch.dtype) -> DeltaRuleInputs:
    # `g` stays fp32, as the model makes it.
    q, k, v, g, beta = inputs.tensors()

    return DeltaRuleInputs(
        q.to(CUDA, dtype), k.to(CUDA, dtype), v.to(CUDA, dtype), g.to(CUDA), beta.to(CUDA, dtype)
    )


class TestFlaBackend:
    def test_is_resolved_on_cuda(self) -> None:
        assert resolve_gdn_backend("auto", CUDA) == "fla"
        assert resolve_gdn_backend("fla", CUDA) == "fla"

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize(
        "lengths", [None, [1, 63, 64, 65, 300, 7]], ids=["B2-T500-H2-HV4-K64-V64", "packed-1-63-64-65-300-7"]
    )
    def test_gated_delta_rule_matches_torch_backend(self, lengths: list[int] | None, dtype: torch.dtype) -> None:
        batch_size, seq_len = (2, 500) if lengths is None else (1, sum(lengths))

        num_seqs = batch_size if lengths is None else len(lengths)

        inputs = to_cuda(make_delta_rule_inputs(batch_size, seq_len, 2, 4, 64, 64, max_decay=16.0, seed=50), dtype)

        gen = torch.Generator().manual_seed(51)

        h0 = torch.randn(num_seqs, 4, 64, 64, generator=gen).to(CUDA)
        do = torch.randn(batch_size, seq_len, 4, 64, generator=gen).to(CUDA, dtype)
        dht = torch.randn(num_seqs, 4, 64, 64, generator=gen).to(CUDA)

        cu_seqlens = None if lengths is None else cu_seqlens_of(lengths).to(CUDA)

        expected = run_with_grads("torch", inputs, h0, do, dht, cu_seqlens=cu_seqlens)

        actual = run_with_grads("fla", inputs, h0, do, dht, cu_seqlens=cu_seqlens)

        assert actual["o"].dtype == dtype
        assert actual["ht"].dtype == torch.float32

        for name, ratio in TOLERANCES.items():
            assert_close(name, expected[name], actual[name], ratio if dtype == torch.float32 else 3 * ratio)

    def test_decoding_one_token_matches_torch_backend(self) -> None:
        inputs = to_cuda(make_delta_rule_inputs(3, 1, 2, 4, 64, 64, seed=52), torch.bfloat16)

        h0 = torch.randn(3, 4, 64, 64, device=CUDA)

        with torch.no_grad():
            expected_o, expected_ht = gated_delta_rule(
                *inputs.tensors(), backend="torch", initial_state=h0, output_final_state=True
            )

            o, ht = gated_delta_rule(*inputs.tensors(), backend="fla", initial_state=h0, output_final_state=True)

        assert_close("o", expected_o, o, 1e-2)
        assert_close("ht", expected_ht, ht, 5e-3)

    @pytest.mark.parametrize("with_states", [False, True], ids=["stateless", "with-states"])
    @pytest.mark.parametrize("lengths", [None, [1, 3, 4, 200, 2]], ids=["B2-T300", "packed-1-3-4-200-2"])
    def test_causal_conv1d_matches_torch_backend(self, lengths: list[int] | None, with_states: bool) -> None:
        batch_size, seq_len = (2, 300) if lengths is None else (1, sum(lengths))

        num_seqs = batch_size if lengths is None else len(lengths)

        gen = torch.Generator().manual_seed(53)

        x = torch.randn(batch_size, seq_len, 384, generator=gen).to(CUDA)
        weight = torch.randn(384, 4, generator=gen).to(CUDA)
        h0 = torch.randn(num_seqs, 384, 3, generator=gen).to(CUDA) if with_states else None
        dy = torch.randn(batch_size, seq_len, 384, generator=gen).to(CUDA)

        cu_seqlens = None if lengths is None else cu_seqlens_of(lengths).to(CUDA)

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

            torch.autograd.backward([y], [dy])

            results[backend] = {"y": y, "ht": ht, "dx": leaves[0].grad, "dweight": leaves[1].grad}  # type: ignore[union-attr]

            if with_states:
                results[backend]["dh0"] = leaves[2].grad  # type: ignore[union-attr]

        for name, expected in results["torch"].items():
            if expected is not None:
                assert_close(name, expected, results["fla"][name], 1e-5)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_gated_rms_norm_matches_torch_backend(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(54)

        x = torch.randn(2, 50, 4, 128, generator=gen).to(CUDA, dtype).requires_grad_()
        gate = torch.randn(2, 50, 4, 128, generator=gen).to(CUDA, dtype).requires_grad_()
        weight = (torch.rand(128, generator=gen) + 0.5).to(CUDA, dtype).requires_grad_()
        dy = torch.randn(2, 50, 4, 128, generator=gen).to(CUDA, dtype)

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
