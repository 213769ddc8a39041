"""The Gated DeltaNet layer on its fla kernels against its PyTorch ones, with
packed documents, activation checkpointing, incremental decoding and
``torch.compile``: on CUDA, or, without a GPU, on the CPU under Triton's
interpreter (fp32 and small heads there; see ``tests/fla_interpreter.py``
and docs/gpu.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fairseq2.nn import BatchLayout, IncrementalStateBag

from fla_interpreter import fla_test_device
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet
from qwen35_fs2.ops.backend import fla_unavailable_reason

DEVICE = fla_test_device()

ON_CUDA = DEVICE is not None and DEVICE.type == "cuda"

pytestmark = [
    pytest.mark.skipif(DEVICE is None, reason="the fla kernels need a CUDA device or Triton's interpreter"),
    *([pytest.mark.cuda] if ON_CUDA else []),
    # The interpreter also evaluates masked-out lanes, which may overflow.
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]

_LENGTHS = [1, 3, 63, 64, 65, 200] if ON_CUDA else [1, 3, 63, 65, 7]

# The padded batch's rows. Under the interpreter, whose time goes by the
# chunk, three: a full row and two padded ones, each two chunks wide (six
# chunks; the five rows of `_LENGTHS` were ten); the documents of 1 and 3
# tokens run in the packed batch.
_PADDED_LENGTHS = _LENGTHS if ON_CUDA else [63, 65, 7]

# The released head sizes (K = V = 128) on the GPU, so that real-size code
# paths run; tiny ones under the interpreter.
_MODEL_DIM, _HEAD_DIM = (256, 128) if ON_CUDA else (64, 16)

# Under the interpreter both backends compute in fp32 and agree to 1e-6,
# except the gradients of the decay parameters: fla sums the log decays of a
# chunk in fp32, we in fp64, and under strong decay (A up to 16) their
# differences lose digits; measured against an fp64 run, ours are within 1e-4
# and fla's within 1.3e-3.
_DTYPES = [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)] if ON_CUDA else [(torch.float32, 1e-4)]

_DECAY_GRAD_TOL = 5e-3

# Inductor on CUDA, as users compile. Under the interpreter ``aot_eager``
# traces the same graph (dynamo, fla's kernels as custom operators with their
# fake kernels and autograd, AOTAutograd), without inductor's C++ code
# generation for the layer's elementwise work: that took minutes a test on
# the 2-core machine's slow hours, to compile code that only stands in for
# CUDA's (tests/unit/nn/test_compile_fullgraph.py compiles the torch layer
# with inductor).
_COMPILE_BACKEND = "inductor" if ON_CUDA else "aot_eager"


@pytest.fixture(autouse=True)
def require_fla() -> None:
    reason = fla_unavailable_reason()

    if reason is not None:
        pytest.skip(f"the fla backend is unavailable: {reason}")


def _make_layers(dtype: torch.dtype) -> tuple[GatedDeltaNet, GatedDeltaNet]:
    torch.manual_seed(0)

    layer = GatedDeltaNet(_MODEL_DIM, 2, 4, _HEAD_DIM, _HEAD_DIM, 4, backend="torch", device=DEVICE, dtype=dtype)

    with torch.no_grad():
        layer.norm.weight.add_(0.1 * torch.randn_like(layer.norm.weight))

    fla_layer = copy.deepcopy(layer)

    for module in fla_layer.modules():
        if hasattr(module, "backend"):
            module.backend = "fla"

    return layer, fla_layer


def _run(
    layer: GatedDeltaNet, x: torch.Tensor, layout: BatchLayout, cotangent: torch.Tensor, *, checkpointed: bool = False
) -> dict[str, torch.Tensor]:
    """The output and gradients of ``layer``, run under activation
    checkpointing (recomputed in the backward pass) if ``checkpointed``."""
    x = x.detach().clone().requires_grad_()

    if checkpointed:
        y = checkpoint(layer, x, layout, use_reentrant=False)
    else:
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

        name_tol = max(tol, _DECAY_GRAD_TOL) if name.startswith("ddecay.") else tol

        assert error <= name_tol, f"{name}: relative RMS error {error:.3g} > {name_tol}"


def _packed_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, BatchLayout]:
    width = sum(_LENGTHS) + 7

    # A padded tail: a document of its own for the kernels.
    layout = BatchLayout((width,), _LENGTHS, packed=True, device=DEVICE)

    return torch.randn(width, _MODEL_DIM, device=DEVICE, dtype=dtype), layout


@pytest.mark.parametrize("dtype, tol", _DTYPES, ids=["fp32", "bf16"][: len(_DTYPES)])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_fla_layer_matches_torch_layer(dtype: torch.dtype, tol: float, packed: bool) -> None:
    layer, fla_layer = _make_layers(dtype)

    if packed:
        x, layout = _packed_inputs(dtype)
    else:
        layout = BatchLayout((len(_PADDED_LENGTHS), max(_PADDED_LENGTHS)), _PADDED_LENGTHS, device=DEVICE)

        x = torch.randn(len(_PADDED_LENGTHS), max(_PADDED_LENGTHS), _MODEL_DIM, device=DEVICE, dtype=dtype)

    cotangent = torch.randn(x.shape, device=DEVICE)

    # Padding positions carry no loss.
    real = (layout.position_indices >= 0).unsqueeze(-1)

    cotangent = cotangent * real

    _assert_close(_run(layer, x, layout, cotangent), _run(fla_layer, x, layout, cotangent), tol)


def test_fla_layer_recomputes_the_same_under_activation_checkpointing() -> None:
    dtype, tol = _DTYPES[-1]

    layer, fla_layer = _make_layers(dtype)

    x, layout = _packed_inputs(dtype)

    cotangent = torch.randn(x.shape, device=DEVICE) * (layout.position_indices >= 0).unsqueeze(-1)

    # The PyTorch layer as the reference (an fla run without checkpointing,
    # compared in `test_fla_layer_matches_torch_layer`, would double the
    # interpreter's time): recomputed with other documents, the gradients
    # would be off by far more than the backends' rounding.
    expected = _run(layer, x, layout, cotangent)

    # The recomputation reuses fla's varlen helpers cached for the offsets of
    # the first pass; they must still be those of this batch.
    _assert_close(expected, _run(fla_layer, x, layout, cotangent, checkpointed=True), tol)


def test_fla_layer_decodes_16_tokens_as_the_torch_layer_runs_them_at_once() -> None:
    layer, fla_layer = _make_layers(torch.float32)

    layer.eval()
    fla_layer.eval()

    prompt_len, num_steps = 5, 16

    x = torch.randn(2, prompt_len + num_steps, _MODEL_DIM, device=DEVICE)

    with torch.no_grad():
        expected = layer(x, BatchLayout.of(x))

        state_bag = IncrementalStateBag(max_num_steps=prompt_len + num_steps + 1)

        prefix = x[:, :prompt_len]

        outputs = [fla_layer(prefix, BatchLayout.of(prefix), state_bag=state_bag)]

        state_bag.increment_step_nr(prompt_len)

        for step in range(prompt_len, prompt_len + num_steps):
            token = x[:, step : step + 1]

            outputs.append(fla_layer(token, BatchLayout.of(token), state_bag=state_bag))

            state_bag.increment_step_nr()

    _assert_close({"y": expected}, {"y": torch.cat(outputs, dim=1)}, 5e-3 if ON_CUDA else 1e-5)


@pytest.mark.slow
def test_fla_layer_compiles_without_graph_breaks() -> None:
    # fla's kernels are custom operators under `torch.compile`: the layer is
    # one graph, forward and backward (the operators are checked on packed
    # batches and with states in `test_fla_kernels.py`).
    dtype = torch.bfloat16 if ON_CUDA else torch.float32

    _, fla_layer = _make_layers(dtype)

    # The interpreter runs one chunk.
    seq_len = 128 if ON_CUDA else 40

    layout = BatchLayout((2, seq_len), [seq_len, seq_len - 29], device=DEVICE)

    x = torch.randn(2, seq_len, _MODEL_DIM, device=DEVICE, dtype=dtype)

    cotangent = torch.randn(x.shape, device=DEVICE) * (layout.position_indices >= 0).unsqueeze(-1)

    expected = _run(fla_layer, x, layout, cotangent)

    compiled = copy.deepcopy(fla_layer)

    torch._dynamo.reset()

    compiled.compile(fullgraph=True, backend=_COMPILE_BACKEND)

    # The same kernels: equal to fp32 rounding under the interpreter; on
    # CUDA, the compiled elementwise code rounds bf16 differently.
    _assert_close(expected, _run(compiled, x, layout, cotangent), 1e-2 if ON_CUDA else 1e-5)


@pytest.mark.skipif(ON_CUDA, reason="sets fla's flags to those of a Hopper GPU: on a GPU the tests above run on the real one")
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_fla_layer_trains_on_hopper_with_triton_3_6(hopper_with_triton_3_6: None, compiled: bool) -> None:
    """Where fla-core refuses one kernel of its backward (fla issue #640),
    the fla layer, with our PyTorch version of that kernel
    (``qwen35_fs2.compat.fla_hopper_dqkwg``), matches the torch layer on a
    packed batch, eager and compiled with ``fullgraph=True`` (where fla's
    kernels are custom operators)."""
    layer, fla_layer = _make_layers(torch.float32)

    x, layout = _packed_inputs(torch.float32)

    cotangent = torch.randn(x.shape, device=DEVICE) * (layout.position_indices >= 0).unsqueeze(-1)

    if compiled:
        torch._dynamo.reset()

        fla_layer.compile(fullgraph=True, backend=_COMPILE_BACKEND)

    _assert_close(_run(layer, x, layout, cotangent), _run(fla_layer, x, layout, cotangent), _DTYPES[0][1])
