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

    ``auto`` means ``fla`` on CUDA when fla-core imports, and ``torch``
    otherwise; falling back to ``torch`` on CUDA logs a warning (once per
    process and reason). ``fla`` on CPU is accepted only under Triton's
    interpreter (``TRITON_INTERPRET=1``, Triton's debug mode, which runs the
    kernels in Python on the host; the tests use it); ``auto`` never picks it
    there. Never called at import time: it imports fla.

    :raises NotSupportedError: ``fla`` is requested but the device cannot run
        it or fla-core cannot be imported.
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
        raise NotSupportedError(
            f"The 'fla' Gated DeltaNet backend needs fla-core>={_MIN_FLA_VERSION} (`pip install qwen35-fs2[fast]`), but {reason}."
        )

    _warn_fla_fallback(reason)

    return "torch"


@cache
@torch.compiler.assume_constant_result
def fla_unavailable_reason() -> str | None:
    """Returns why fla-core cannot be used, or ``None`` if it can. Imports
    fla (slow) on the first call only.

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
            return "`fla` cannot be imported: it is not installed"

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
        return f"fla-core {version_string} is installed"

    return None


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
        "The Gated DeltaNet layers fall back to their PyTorch kernels on CUDA "
        "(much slower than fla's) because {}. Install qwen35-fs2[fast] to use fla.",
        reason,
    )
