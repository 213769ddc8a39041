"""Kernels of the Gated DeltaNet layers: a pure-PyTorch path that runs
anywhere and, on CUDA, fla / causal-conv1d fast paths."""

from __future__ import annotations

from qwen35_fs2.ops.causal_conv import causal_conv1d as causal_conv1d
from qwen35_fs2.ops.delta_rule import (
    recurrent_gated_delta_rule as recurrent_gated_delta_rule,
)
