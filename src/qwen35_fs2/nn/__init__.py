"""The layers of Qwen3.5, free of any model family's glue: gated attention,
Gated DeltaNet, the MoE block, the norms, partial rotary encoding and the
hybrid decoder layer and stack. The families (:mod:`qwen35_fs2.models`)
assemble them; the kernels they call are in :mod:`qwen35_fs2.ops`."""

from __future__ import annotations

from qwen35_fs2.nn.attention import Qwen35Attention as Qwen35Attention
from qwen35_fs2.nn.decoder import Qwen35Decoder as Qwen35Decoder
from qwen35_fs2.nn.decoder import collect_moe_statistics as collect_moe_statistics
from qwen35_fs2.nn.decoder_layer import Qwen35DecoderLayer as Qwen35DecoderLayer
from qwen35_fs2.nn.gated_deltanet import CausalDepthwiseConv1d as CausalDepthwiseConv1d
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet as GatedDeltaNet
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNetDecay as GatedDeltaNetDecay
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNetState as GatedDeltaNetState
from qwen35_fs2.nn.moe import MoeStatistics as MoeStatistics
from qwen35_fs2.nn.moe import Qwen35MoeBlock as Qwen35MoeBlock
from qwen35_fs2.nn.moe import MoeStatisticsRecorder as MoeStatisticsRecorder
from qwen35_fs2.nn.normalization import GatedRMSNorm as GatedRMSNorm
from qwen35_fs2.nn.normalization import ZeroCenteredRMSNorm as ZeroCenteredRMSNorm
from qwen35_fs2.nn.rotary import PartialRotaryEncoder as PartialRotaryEncoder
