"""Kernels of the Gated DeltaNet layers: a pure-PyTorch path that runs
anywhere and, on CUDA, fla / causal-conv1d fast paths.

The model resolves a backend once, at construction, with
:func:`resolve_gdn_backend`, then passes it to :func:`causal_conv1d`,
:func:`gated_delta_rule` and :func:`gated_rms_norm`. Packed batches pass
``cu_seqlens`` to the first two: neither the convolution nor the recurrent
state crosses a document boundary.
"""

from __future__ import annotations

from qwen35_fs2.ops.backend import GdnBackend as GdnBackend
from qwen35_fs2.ops.backend import GdnBackendRequest as GdnBackendRequest
from qwen35_fs2.ops.backend import resolve_gdn_backend as resolve_gdn_backend
from qwen35_fs2.ops.causal_conv import causal_conv1d as causal_conv1d
from qwen35_fs2.ops.delta_rule import (
    chunk_gated_delta_rule as chunk_gated_delta_rule,
)
from qwen35_fs2.ops.delta_rule import gated_delta_rule as gated_delta_rule
from qwen35_fs2.ops.delta_rule import (
    recurrent_gated_delta_rule as recurrent_gated_delta_rule,
)
from qwen35_fs2.ops.norm import gated_rms_norm as gated_rms_norm
