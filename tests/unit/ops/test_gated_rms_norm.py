"""The gated RMSNorm of the Gated DeltaNet output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from qwen35_fs2.ops import gated_rms_norm

from .helpers import assert_close


class TestGatedRmsNorm:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_matches_fp64_formula(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(40)

        x = torch.randn(2, 7, 3, 16, generator=gen, dtype=torch.float64) * 3.0
        gate = torch.randn(2, 7, 3, 16, generator=gen, dtype=torch.float64)
        weight = torch.rand(16, generator=gen, dtype=torch.float64) + 0.5

        # A plain weight (no `1 +`), normalization before the gate.
        expected = weight * x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * F.silu(gate)

        y = gated_rms_norm(x.to(dtype), gate.to(dtype), weight.float(), 1e-6)

        assert y.dtype == dtype

        assert_close("y", expected, y, 1e-6 if dtype == torch.float32 else 1e-2)

    def test_backward_passes_gradcheck_in_float64(self) -> None:
        gen = torch.Generator().manual_seed(41)

        x, gate, weight = (torch.randn(5, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))

        weight = weight[0].detach().requires_grad_()

        def fn(x: Tensor, gate: Tensor, weight: Tensor) -> Tensor:
            return gated_rms_norm(x, gate, weight, 1e-6)

        assert torch.autograd.gradcheck(fn, (x, gate, weight))

    def test_raises_error_when_gate_has_another_shape(self) -> None:
        with pytest.raises(ValueError, match=r"`gate` must be of the shape of `x` \(2, 4\)"):
            gated_rms_norm(torch.ones(2, 4), torch.ones(2, 3), torch.ones(4), 1e-6)

    def test_raises_error_when_weight_has_wrong_shape(self) -> None:
        with pytest.raises(ValueError, match=r"`weight` must be of shape \(4,\)"):
            gated_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(3), 1e-6)
