"""Chooses between the pure-PyTorch and the fla kernels of the Gated DeltaNet
layers."""

from __future__ import annotations

import importlib
from functools import cache
from typing import Literal, TypeAlias

import torch
from fairseq2.error import NotSupportedError
from fairseq2.logging import log

GdnBackend: TypeAlias = Literal["torch", "fla"]
"""``torch``: pure PyTorch, runs anywhere. ``fla``: fla-core's Triton kernels
(and Dao-AILab's ``causal_conv1d`` when installed); CUDA only."""

GdnBackendRequest: TypeAlias = Literal["auto", "torch", "fla"]

_MIN_FLA_VERSION = (0, 6, 0)


def resolve_gdn_backend(requested: GdnBackendRequest, device: torch.device) -> GdnBackend:
    """Resolves ``requested`` for ``device``; call once, when building a model.

    ``auto`` means ``fla`` on CUDA when fla-core imports, and ``torch``
    otherwise; falling back to ``torch`` on CUDA logs a warning (once per
    process and reason). Never called at import time: it imports fla.

    :raises NotSupportedError: ``fla`` is requested but the device is not CUDA
        or fla-core cannot be imported.
    """
    if requested == "torch":
        return "torch"

    if requested not in ("auto", "fla"):
        raise ValueError(
            f"`requested` must be 'auto', 'torch', or 'fla', but is '{requested}' instead."
        )

    if device.type != "cuda":
        if requested == "fla":
            raise NotSupportedError(
                f"The 'fla' Gated DeltaNet backend needs a CUDA device, but the device is '{device}' instead. Use the 'torch' backend."
            )

        return "torch"

    reason = fla_unavailable_reason()

    if reason is None:
        return "fla"

    if requested == "fla":
        raise NotSupportedError(
            f"The 'fla' Gated DeltaNet backend needs fla-core>=0.6.0 (`pip install qwen35-fs2[fast]`), but {reason}."
        )

    _warn_fla_fallback(reason)

    return "torch"


@cache
def fla_unavailable_reason() -> str | None:
    """Returns why fla-core cannot be used, or ``None`` if it can. Imports
    fla (slow) on the first call only."""
    try:
        fla = importlib.import_module("fla")

        importlib.import_module("fla.ops.gated_delta_rule")
        importlib.import_module("fla.modules.causal_conv1d")
        importlib.import_module("fla.modules.fused_norm_gate")
    except Exception as ex:  # fla fails with more than `ImportError` on odd setups.
        return f"`fla` cannot be imported ({type(ex).__name__}: {ex})"

    version = getattr(fla, "__version__", "0")

    try:
        version_tuple = tuple(int(part) for part in version.split(".")[:3])
    except ValueError:
        version_tuple = (0,)

    if version_tuple < _MIN_FLA_VERSION:
        return f"fla-core {version} is installed"

    return None


@cache
def has_causal_conv1d() -> bool:
    """Returns ``True`` if Dao-AILab's ``causal_conv1d`` CUDA package imports."""
    try:
        importlib.import_module("causal_conv1d")
    except Exception:
        return False

    return True


@cache
def _warn_fla_fallback(reason: str) -> None:
    log.warning(
        "The Gated DeltaNet layers fall back to their PyTorch kernels on CUDA "
        "(much slower than fla's) because {}. Install qwen35-fs2[fast] to use fla.",
        reason,
    )
