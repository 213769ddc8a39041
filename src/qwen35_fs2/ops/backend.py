"""Chooses between the pure-PyTorch and the fla kernels of the Gated DeltaNet
layers."""

from __future__ import annotations

import importlib
import os
from functools import cache
from typing import Final, Literal, TypeAlias

import torch
from packaging.version import InvalidVersion, Version

from fairseq2.error import NotSupportedError
from fairseq2.logging import log

from qwen35_fs2.compat.fla_hopper_dqkwg import (
    fla_dispatch_disabled,
    fla_needs_torch_dqkwg,
    register_torch_chunk_bwd_dqkwg,
)

GdnBackend: TypeAlias = Literal["torch", "fla"]
"""``torch``: pure PyTorch, runs anywhere. ``fla``: fla-core's Triton kernels
(and Dao-AILab's ``causal_conv1d`` when installed); CUDA only, or CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, for tests)."""

GdnBackendRequest: TypeAlias = Literal["auto", "torch", "fla"]

_MIN_FLA_VERSION: Final = Version("0.6.0")


def resolve_gdn_backend(requested: GdnBackendRequest, device: torch.device) -> GdnBackend:
    """Resolves ``requested`` for tensors on ``device``.

    The layers call it in every forward pass, for the device of their input,
    so that a model moved to another device runs the kernels that device can
    run (cheap: what it imports and checks is cached).

    ``auto`` means ``fla`` on CUDA when fla-core imports and can train on
    the GPU, and ``torch`` otherwise; falling back to ``torch`` on CUDA logs
    a warning (once per process and reason). ``fla`` on CPU is accepted only
    under Triton's interpreter (``TRITON_INTERPRET=1``, Triton's debug mode,
    which runs the kernels in Python on the host; the tests use it); ``auto``
    never picks it there. Never called at import time: it imports fla.

    :raises NotSupportedError: ``fla`` is requested but the device cannot run
        it, fla-core cannot be imported, or fla-core refuses to train on the
        GPU.
    """
    if requested == "torch":
        return "torch"

    if requested not in ("auto", "fla"):
        raise ValueError(
            f"`requested` must be 'auto', 'torch', or 'fla', but is '{requested}' instead."
        )

    return _resolve(requested, device.type, is_triton_interpreting())


def is_triton_interpreting() -> bool:
    """Returns ``True`` if Triton runs its kernels in its interpreter
    (``TRITON_INTERPRET=1`` when the kernels were defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _resolve(
    requested: Literal["auto", "fla"], device_type: str, interpreting: bool
) -> GdnBackend:
    if device_type != "cuda":
        if requested == "auto":
            return "torch"

        if not (device_type == "cpu" and interpreting):
            raise NotSupportedError(
                f"The 'fla' Gated DeltaNet backend needs a CUDA device, but the device is '{device_type}' instead. Use the 'torch' backend (or, to test fla's kernels on CPU, set TRITON_INTERPRET=1 before importing fla)."
            )

    reason = fla_unavailable_reason()

    if reason is None:
        return "fla"

    if requested == "fla":
        raise NotSupportedError(f"The 'fla' Gated DeltaNet backend cannot be used: {reason}.")

    _warn_fla_fallback(reason)

    return "torch"


@cache
@torch.compiler.assume_constant_result
def fla_unavailable_reason() -> str | None:
    """Returns why fla-core cannot be used, with what to install, or
    ``None`` if it can. Imports fla (slow) on the first call only.

    Under ``torch.compile`` it runs once as the graph is traced and its
    result is a constant of the graph; dynamo would otherwise trace into the
    import, and break the graph there. (Dynamo looks through ``cache`` to
    the function it wraps, which carries the mark.)"""
    try:
        fla = importlib.import_module("fla")

        importlib.import_module("fla.ops.gated_delta_rule")
        importlib.import_module("fla.modules.causal_conv1d")
        importlib.import_module("fla.modules.fused_norm_gate")
    except Exception as ex:  # fla fails with more than `ImportError` on odd setups.
        if _is_absent(ex, "fla"):
            return f"`fla` cannot be imported: it is not installed (`pip install qwen35-fs2[fast]` installs fla-core>={_MIN_FLA_VERSION})"

        log.warning("fla-core is installed but cannot be imported: {}: {}", type(ex).__name__, ex)

        return f"`fla` cannot be imported ({type(ex).__name__}: {ex})"

    version_string = str(getattr(fla, "__version__", "0"))

    try:
        version = Version(version_string)
    except InvalidVersion:
        return f"fla-core reports an unreadable version '{version_string}'"

    # Pre-releases and development builds of 0.6.0 and later are as new as
    # 0.6.0 for this check.
    if Version(version.base_version) < _MIN_FLA_VERSION:
        return f"it needs fla-core>={_MIN_FLA_VERSION}, but fla-core {version_string} is installed (`pip install qwen35-fs2[fast]`)"

    return _fla_backward_refusal()


def _fla_backward_refusal() -> str | None:
    """Returns why fla-core refuses the backward pass of its gated delta
    rule on this machine's GPU, or ``None`` if it runs it.

    fla-core refuses it on Hopper GPUs with Triton 3.4.0 to 3.7.0 (fla issue
    #640) unless its TileLang backend is usable; there our PyTorch version of
    the one kernel concerned takes over (:mod:`qwen35_fs2.compat.fla_hopper_dqkwg`),
    registered here, before any of fla's kernels runs. Only with fla's
    dispatch turned off can it not, and fla would fail at the first backward
    pass.
    """
    if not fla_needs_torch_dqkwg():
        return None

    if not fla_dispatch_disabled():
        register_torch_chunk_bwd_dqkwg()

        return None

    triton_version = importlib.import_module("triton").__version__

    return (
        f"fla-core refuses to train on Hopper GPUs with Triton {triton_version}, which compiles its Gated DeltaNet "
        "backward wrong there (fla issue #640), and FLA_DISABLE_BACKEND_DISPATCH=1 keeps our PyTorch version of "
        "that kernel from taking over; unset it, or install Triton>=3.7.1 or TileLang (`pip install tilelang`)"
    )


@cache
@torch.compiler.assume_constant_result
def has_causal_conv1d() -> bool:
    """Returns ``True`` if Dao-AILab's ``causal_conv1d`` CUDA package imports;
    a constant of ``torch.compile`` graphs, as :func:`fla_unavailable_reason`.

    An installed package that fails to import (e.g. a build for another
    PyTorch ABI) is logged with its reason instead of passing for absent.
    """
    try:
        importlib.import_module("causal_conv1d")
    except Exception as ex:
        if not _is_absent(ex, "causal_conv1d"):
            log.warning(
                "causal-conv1d is installed but cannot be imported, so fla's Triton convolution runs instead: {}: {}",
                type(ex).__name__,
                ex,
            )

        return False

    return True


def _is_absent(ex: Exception, package: str) -> bool:
    """Returns ``True`` if ``ex`` says that ``package`` itself is not
    installed (not that something it imports failed)."""
    return isinstance(ex, ModuleNotFoundError) and ex.name == package


@cache
def _warn_fla_fallback(reason: str) -> None:
    log.warning(
        "The Gated DeltaNet layers fall back to their PyTorch kernels on CUDA (much slower than fla's): {}.", reason
    )
