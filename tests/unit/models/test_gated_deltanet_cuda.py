"""The Gated DeltaNet layer on its fla kernels against its PyTorch ones, with
packed documents, activation checkpointing and ``torch.compile`` (CUDA only;
see docs/gpu.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fairseq2.nn import BatchLayout

from qwen35_fs2.models.gated_deltanet import GatedDeltaNet
from qwen35_fs2.ops.backend import fla_unavailable_reason

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fla kernels need a CUDA device"),
]

_LENGTHS = [1, 3, 63, 64, 65, 200]


@pytest.fixture(autouse=True)
def require_fla() -> None:
    reason = fla_unavailable_reason()

    if reason is not None:
        pytest.skip(f"the fla backend is unavailable: {reason}")


def _make_layers(dtype: torch.dtype) -> tuple[GatedDeltaNet, GatedDeltaNet]:
    torch.manual_seed(0)

    # The released head sizes (K = V = 128), so real-size code paths run.
    layer = GatedDeltaNet(256, 2, 4, 128, 128, 4, backend="torch", device=torch.device("cuda"), dtype=dtype)

    with torch.no_grad():
        layer.norm.weight.add_(0.1 * torch.randn_like(layer.norm.weight))

    fla_layer = copy.deepcopy(layer)

    for module in fla_layer.modules():
        if hasattr(module, "backend"):
            module.backend = "fla"

    return layer, fla_layer


def _run(layer: GatedDeltaNet, x: torch.Tensor, layout: BatchLayout, cotangent: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_()

    y = layer(x, layout)

    (y.float() * cotangent).sum().backward()

    assert x.grad is not None

    results = {"y": y.detach().float(), "dx": x.grad.float()}

    for name, param in layer.named_parameters():
        assert param.grad is not None

        results[f"d{name}"] = param.grad.float()

    return results


def _assert_close(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], tol: float) -> None:
    for name, value in expected.items():
        # The RMS error relative to the RMS of the reference, as fla's tests.
        error = ((actual[name] - value).pow(2).mean().sqrt() / value.pow(2).mean().sqrt().clamp(min=1e-12)).item()

        assert error <= tol, f"{name}: relative RMS error {error:.3g} > {tol}"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_fla_layer_matches_torch_layer(dtype: torch.dtype, tol: float, packed: bool) -> None:
    layer, fla_layer = _make_layers(dtype)

    if packed:
        width = sum(_LENGTHS) + 7

        layout = BatchLayout((width,), _LENGTHS, packed=True, device=torch.device("cuda"))

        x = torch.randn(width, 256, device="cuda", dtype=dtype)
    else:
        layout = BatchLayout((len(_LENGTHS), max(_LENGTHS)), _LENGTHS, device=torch.device("cuda"))

        x = torch.randn(len(_LENGTHS), max(_LENGTHS), 256, device="cuda", dtype=dtype)

    cotangent = torch.randn(x.shape, device="cuda")

    # Padding positions carry no loss.
    real = (layout.position_indices >= 0).unsqueeze(-1)

    cotangent = cotangent * real

    _assert_close(_run(layer, x, layout, cotangent), _run(fla_layer, x, layout, cotangent), tol)


def test_fla_layer_recomputes_the_same_under_activation_checkpointing() -> None:
    _, fla_layer = _make_layers(torch.bfloat16)

    width = sum(_LENGTHS)

    layout = BatchLayout((width,), _LENGTHS, packed=True, device=torch.device("cuda"))

    x = torch.randn(width, 256, device="cuda", dtype=torch.bfloat16)

    cotangent = torch.randn(x.shape, device="cuda")

    expected = _run(fla_layer, x, layout, cotangent)

    fla_layer.zero_grad()

    checkpointed = copy.deepcopy(fla_layer)

    x2 = x.detach().clone().requires_grad_()

    # Recomputation must not reuse fla's varlen helpers cached by tensor
    # identity (the layer passes fresh offsets on every call).
    y = checkpoint(lambda t: checkpointed(t, layout), x2, use_reentrant=False)

    (y.float() * cotangent).sum().backward()

    assert x2.grad is not None

    # Not bitwise: fla's backward may accumulate with atomics.
    _assert_close({"dx": expected["dx"]}, {"dx": x2.grad.float()}, 1e-3)


def test_fla_layer_runs_under_torch_compile() -> None:
    layer, fla_layer = _make_layers(torch.bfloat16)

    layout = BatchLayout((2, 128), [128, 100], device=torch.device("cuda"))

    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)

    cotangent = torch.randn(x.shape, device="cuda") * (layout.position_indices >= 0).unsqueeze(-1)

    expected = _run(fla_layer, x, layout, cotangent)

    compiled = copy.deepcopy(fla_layer)

    compiled.compile(fullgraph=False)

    _assert_close(expected, _run(compiled, x, layout, cotangent), 1e-2)
