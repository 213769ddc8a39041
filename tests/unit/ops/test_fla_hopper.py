"""Our PyTorch ``chunk_bwd_dqkwg`` (``qwen35_fs2.compat.fla_hopper_dqkwg``, for
Hopper GPUs with Triton 3.4.0 to 3.7.0, fla issue #640) against fla's
Triton kernel, and fla's gated delta rule backward with ours taking over.

Without a GPU, fla's kernels run under Triton's interpreter (fp32, tiny
shapes), and the Hopper GPU is what fla's flags say it is: the flags that
fla's own check reads (``fla.ops.common.chunk_o``) are set to those of an
H200 with Triton 3.6.0 (the machine where fla refused), not a mock of our
code. On a GPU the comparison with fla's kernel runs where that kernel is
right (not on Hopper with Triton < 3.7.1); there the layer tests of
``test_fla_kernels.py`` compare fla, with ours inside, against our PyTorch
delta rule."""

from __future__ import annotations

import inspect
import pytest
import torch
from torch import Tensor

import qwen35_fs2.ops.backend as backend_module
from fla_interpreter import fla_test_device
from qwen35_fs2.compat import fla_hopper_dqkwg as fla_hopper
from qwen35_fs2.compat.fla_hopper_dqkwg import chunk_bwd_dqkwg, fla_refuses_gated_backward

from .helpers import assert_close, cu_seqlens_of

DEVICE = fla_test_device()

ON_CUDA = DEVICE is not None and DEVICE.type == "cuda"

pytestmark = [
    pytest.mark.skipif(DEVICE is None, reason="the fla kernels need a CUDA device or Triton's interpreter"),
    *([pytest.mark.cuda] if ON_CUDA else []),
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]

CHUNK_SIZE = 64

# (B, T, H, HV, K, V)
SHAPE = (2, 130, 2, 4, 64, 64) if ON_CUDA else (2, 130, 2, 4, 16, 16)

LENGTHS = [1, 63, 64, 65, 7]


def _fla_kernel() -> object:
    """fla's own ``chunk_bwd_dqkwg``, past its dispatch (which would pick
    ours where ours is registered and available)."""
    from fla.ops.common import chunk_o

    return inspect.unwrap(chunk_o.chunk_bwd_dqkwg)


def make_inputs(
    lengths: list[int] | None, state_v_first: bool, dtype: torch.dtype = torch.float32
) -> dict[str, object]:
    """fla's arguments for a gated call, with states and gate sums of the
    size and range of a real one."""
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices

    assert DEVICE is not None

    batch_size, seq_len, num_heads, num_v_heads, k_dim, v_dim = SHAPE

    cu_seqlens = chunk_indices = None

    if lengths is not None:
        batch_size, seq_len = 1, sum(lengths)

        cu_seqlens = cu_seqlens_of(lengths, torch.long).to(DEVICE)

        chunk_indices = prepare_chunk_indices(cu_seqlens, CHUNK_SIZE)

        # fla's states of a packed batch: one row of all its chunks.
        states_shape = (1, len(chunk_indices))
    else:
        states_shape = (batch_size, -(-seq_len // CHUNK_SIZE))

    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    states_shape += (num_v_heads, v_dim, k_dim) if state_v_first else (num_v_heads, k_dim, v_dim)

    log_gates = -torch.rand(batch_size, seq_len, num_v_heads, generator=gen).to(DEVICE) * 0.2

    g = chunk_local_cumsum(log_gates, chunk_size=CHUNK_SIZE, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)

    return {
        "q": randn(batch_size, seq_len, num_heads, k_dim, scale=k_dim**-0.5),
        "k": randn(batch_size, seq_len, num_heads, k_dim, scale=k_dim**-0.5),
        "v": randn(batch_size, seq_len, num_v_heads, v_dim),
        "do": randn(batch_size, seq_len, num_v_heads, v_dim),
        "h": randn(*states_shape),
        "dh": randn(*states_shape),
        "w": randn(batch_size, seq_len, num_v_heads, k_dim),
        "g": g.float(),
        "dv": randn(batch_size, seq_len, num_v_heads, v_dim),
        "scale": k_dim**-0.5,
        "state_v_first": state_v_first,
        "cu_seqlens": cu_seqlens,
        "chunk_size": CHUNK_SIZE,
        "chunk_indices": chunk_indices,
    }


@pytest.mark.skipif(ON_CUDA and fla_refuses_gated_backward(), reason="fla's kernel computes this wrong on this GPU")
class TestAgainstFlaKernel:
    @pytest.mark.parametrize("state_v_first", [False, True], ids=["state_kv", "state_vk"])
    @pytest.mark.parametrize("lengths", [None, LENGTHS], ids=["padded", "packed"])
    def test_matches_fla(self, lengths: list[int] | None, state_v_first: bool) -> None:
        inputs = make_inputs(lengths, state_v_first)

        expected = _fla_kernel()(**inputs)  # type: ignore[operator]

        actual = chunk_bwd_dqkwg(**inputs)  # type: ignore[arg-type]

        for name, want, got in zip(("dq", "dk", "dw", "dg"), expected, actual):
            assert_close(name, want, got, 1e-5)

    @pytest.mark.skipif(not ON_CUDA, reason="bf16 runs wrong under Triton's interpreter")
    def test_matches_fla_in_bf16(self) -> None:
        inputs = make_inputs(LENGTHS, state_v_first=False, dtype=torch.bfloat16)

        expected = _fla_kernel()(**inputs)  # type: ignore[operator]

        actual = chunk_bwd_dqkwg(**inputs)  # type: ignore[arg-type]

        for name, want, got in zip(("dq", "dk", "dw", "dg"), expected, actual):
            assert got is not None and want is not None and got.dtype == want.dtype

            # fla rounds its products' inputs to bf16, ours are fp32.
            assert_close(name, want, got, 2e-2)


def test_fla_refuses_its_kernel_under_the_hopper_flags(hopper_with_triton_3_6: None) -> None:
    # Pins the behaviour the takeover relies on: fla's own function raises.
    inputs = make_inputs(None, state_v_first=False)

    with pytest.raises(RuntimeError, match=r"Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs .* #640"):
        _fla_kernel()(**inputs)  # type: ignore[operator]


@pytest.mark.skipif(ON_CUDA and fla_refuses_gated_backward(), reason="fla's own run, the expected values, is wrong on this GPU")
def test_fla_gated_delta_rule_trains_with_ours_taking_over(hopper_with_triton_3_6: None) -> None:
    """fla's whole gated delta rule, forward and backward, under the Hopper
    flags: the backend check registers ours, fla's dispatch picks it, and
    every gradient equals fla's own run without the flags."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    assert DEVICE is not None

    _, _, num_heads, num_v_heads, k_dim, v_dim = SHAPE

    # Under the interpreter, one sequence of a whole chunk and a part: the
    # test runs fla twice, forward and backward (`TestAgainstFlaKernel`
    # compares the kernels on the batches of SHAPE and on packed documents).
    batch_size, seq_len = SHAPE[:2] if ON_CUDA else (1, CHUNK_SIZE + 6)

    gen = torch.Generator().manual_seed(1)

    leaves = [
        torch.randn(batch_size, seq_len, num_heads, k_dim, generator=gen),
        torch.randn(batch_size, seq_len, num_heads, k_dim, generator=gen),
        torch.randn(batch_size, seq_len, num_v_heads, v_dim, generator=gen),
        -torch.rand(batch_size, seq_len, num_v_heads, generator=gen) * 0.2,
        torch.rand(batch_size, seq_len, num_v_heads, generator=gen),
    ]

    def run() -> list[Tensor]:
        tensors = [x.to(DEVICE).requires_grad_() for x in leaves]

        o, _ = chunk_gated_delta_rule(*tensors, use_qk_l2norm_in_kernel=True)

        o.backward(torch.ones_like(o))

        return [o.detach(), *(x.grad for x in tensors)]  # type: ignore[misc]

    # The layers resolve their backend before running fla: that registers ours.
    assert backend_module.fla_unavailable_reason() is None

    with_ours = run()

    with pytest.MonkeyPatch.context() as patch:
        from fla.ops.common import chunk_o

        patch.setattr(chunk_o, "IS_NVIDIA_HOPPER", False)

        fla_own = run()

    for name, want, got in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), fla_own, with_ours):
        assert_close(name, want, got, 1e-5)


class TestTakeover:
    def test_ours_is_available_only_where_fla_refuses_and_tilelang_is_not_usable(
        self, hopper_with_triton_3_6: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from fla.ops.common import chunk_o
        from fla.ops.common.backends.tilelang import CommonTileLangBackend

        assert fla_hopper.fla_refuses_gated_backward() and not fla_hopper.fla_tilelang_takes_over()

        assert fla_hopper.fla_needs_torch_dqkwg()

        monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", True)

        assert not fla_hopper.fla_refuses_gated_backward()

        monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)
        monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", False)

        assert not fla_hopper.fla_refuses_gated_backward()

        # TileLang cannot be installed here: what fla asks its backend class
        # is made to say yes, and fla enables it on Hopper by default.
        monkeypatch.setattr(CommonTileLangBackend, "is_available", classmethod(lambda cls: True))
        monkeypatch.setattr(CommonTileLangBackend, "default_enable", True)

        assert fla_hopper.fla_tilelang_takes_over()

        # Back on Hopper with Triton 3.6: fla's TileLang fix runs, not ours.
        monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", True)

        assert fla_hopper.fla_refuses_gated_backward() and not fla_hopper.fla_needs_torch_dqkwg()

        monkeypatch.setenv("FLA_TILELANG", "0")

        assert not fla_hopper.fla_tilelang_takes_over()

    def test_our_kernel_ignores_autocast(self) -> None:
        # fla's backward runs under the forward's autocast state.
        assert DEVICE is not None

        inputs = make_inputs(LENGTHS, state_v_first=False)

        expected = chunk_bwd_dqkwg(**inputs)  # type: ignore[arg-type]

        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            actual = chunk_bwd_dqkwg(**inputs)  # type: ignore[arg-type]

        for want, got in zip(expected, actual):
            assert want is not None and got is not None and torch.equal(want, got)

    def test_our_kernel_refuses_the_ungated_case(self) -> None:
        inputs = make_inputs(None, state_v_first=False)

        inputs["g"] = None

        with pytest.raises(ValueError, match="the gated case only"):
            chunk_bwd_dqkwg(**inputs)  # type: ignore[arg-type]
