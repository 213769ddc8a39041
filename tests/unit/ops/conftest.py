"""Fixtures of the kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import qwen35_fs2.ops.backend as backend_module


@pytest.fixture
def hopper_with_triton_3_6(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Sets the flags that fla-core's check in ``chunk_bwd_dqkwg`` reads
    (``fla.ops.common.chunk_o``) to those of an H200 with Triton 3.6.0, the
    machine where fla refused to train (fla issue #640): what fla sees of
    the machine, not a mock of our code. The backend check's caches are
    cleared around it."""
    from fla.ops.common import chunk_o

    monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)

    backend_module.fla_unavailable_reason.cache_clear()
    backend_module._warn_fla_fallback.cache_clear()

    yield

    backend_module.fla_unavailable_reason.cache_clear()
    backend_module._warn_fla_fallback.cache_clear()
