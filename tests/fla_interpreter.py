"""Runs fla's Triton kernels on CPU tensors under Triton's interpreter, so that
the ``fla`` backend is tested on machines without a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``, its debug mode) executes a
kernel's Python body with NumPy, one program at a time. It must be on before
fla is imported (``@triton.jit`` reads it), so the root ``conftest.py`` turns
it on for the whole test session on a machine without CUDA; on a machine with
CUDA the fla tests run on the GPU instead.

fla-core 0.6.0 on triton 3.5.1 needs three shims under the interpreter
(none of them changes what a kernel computes):

1. Autotuning must not benchmark: interpreted timings mean nothing, and each
   candidate configuration would run the whole kernel once more. The
   autotuner then takes the first configuration.
2. The interpreter converts 1-element NumPy arrays with ``int()``, which
   NumPy 2.4 refuses for arrays with a dimension (``__index__`` of its
   tensors); ``.item()`` works with every NumPy.
3. fla's kernels call methods of the loop variables of the builtin ``range``
   (``i_t.to(tl.int64)``), which compiled Triton makes tensors but the
   interpreter leaves Python ints. Inside kernels (whose source the
   interpreter rewrites anyway), ``range`` is replaced by one that yields 0-d
   Triton tensors; host code keeps the builtin.

The interpreter only runs fp32 correctly here (bf16 gives errors of order
1e9), so these tests are fp32; bf16 stays with the CUDA runs.

``hopper_with_triton_3_6`` makes fla see the machine where it refused to
train (fla issue #640), for the tests of ``qwen35_fs2.compat.fla_hopper_dqkwg``.
"""

from __future__ import annotations

import ast
import builtins
import operator
import os
from collections.abc import Iterator
from typing import Any, Final

import pytest
import torch

_KERNEL_RANGE: Final = "_qwen35_interpreted_kernel_range"


def use_triton_interpreter_without_cuda() -> None:
    """Turns Triton's interpreter on and applies the shims when no CUDA device
    is visible (and the user did not choose otherwise). Call before anything
    imports fla."""
    if torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        if os.environ.get("TRITON_INTERPRET") == "1":
            _apply_shims()

        return

    os.environ["TRITON_INTERPRET"] = "1"

    # fla caches autotuning results on disk; there is nothing to cache.
    os.environ.setdefault("FLA_CACHE_RESULTS", "0")

    _apply_shims()


def fla_test_device() -> torch.device | None:
    """The device the fla tests run on: CUDA if available, else the CPU under
    Triton's interpreter, else ``None`` (the tests skip)."""
    if torch.cuda.is_available():
        return torch.device("cuda")

    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")

    return None


def _apply_shims() -> None:
    from triton.runtime import autotuner, interpreter

    if getattr(interpreter, _KERNEL_RANGE, None) is not None:
        return

    # 1. No benchmarking: every configuration "takes" 0 ms.
    def bench_nothing(self: Any, *args: Any, **kwargs: Any) -> list[float]:
        return [0.0, 0.0, 0.0]

    autotuner.Autotuner._bench = bench_nothing

    # 2. `__index__` through `.item()`. The interpreter re-patches its tensor
    # class before every kernel launch, so the patch wraps that function.
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor_with_item(tensor: Any) -> None:
        patch_lang_tensor(tensor)

        tensor.__index__ = lambda self: int(self.handle.data.item())

    interpreter._patch_lang_tensor = patch_lang_tensor_with_item

    # 3. `range` in kernel bodies yields Triton tensors. The interpreter
    # copies the globals of its own module into those of every kernel it
    # rewrites, which is how the kernels find the replacement.
    def kernel_range(*args: Any) -> Iterator[Any]:
        for idx in builtins.range(*(operator.index(arg) for arg in args)):
            yield interpreter.interpreter_semantic.to_tensor(idx, False)

    setattr(interpreter, _KERNEL_RANGE, kernel_range)

    def visit_call(self: ast.NodeTransformer, node: ast.Call) -> ast.Call:
        self.generic_visit(node)

        if isinstance(node.func, ast.Name) and node.func.id == "range":
            node.func = ast.Name(id=_KERNEL_RANGE, ctx=ast.Load())

        return node

    interpreter.ASTTransformer.visit_Call = visit_call


@pytest.fixture
def hopper_with_triton_3_6(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Sets the flags that fla-core's check in ``chunk_bwd_dqkwg`` reads
    (``fla.ops.common.chunk_o``) to those of an H200 with Triton 3.6.0, the
    machine where fla refused to train (fla issue #640): what fla sees of
    the machine, not a mock of our code. The backend check's caches are
    cleared around it."""
    from fla.ops.common import chunk_o

    import qwen35_fs2.ops.backend as backend_module

    monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)

    backend_module.fla_unavailable_reason.cache_clear()
    backend_module._warn_fla_fallback.cache_clear()

    yield

    backend_module.fla_unavailable_reason.cache_clear()
    backend_module._warn_fla_fallback.cache_clear()
