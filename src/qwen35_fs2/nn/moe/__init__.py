"""The sparse Mixture-of-Experts block of Qwen3.5-MoE (and Qwen3-Next): its
router, its routed experts, and the routing statistics that training turns
into the load-balancing loss (:func:`~qwen35_fs2.nn.collect_moe_statistics`
collects them from the decoder that recorded them)."""

from __future__ import annotations

from qwen35_fs2.nn.moe.block import Qwen35MoeBlock as Qwen35MoeBlock
from qwen35_fs2.nn.moe.experts import ExpertDispatch as ExpertDispatch
from qwen35_fs2.nn.moe.experts import RoutedExperts as RoutedExperts
from qwen35_fs2.nn.moe.router import RouterPrecision as RouterPrecision
from qwen35_fs2.nn.moe.router import TopKRouter as TopKRouter
from qwen35_fs2.nn.moe.statistics import MoeRoutingStatistics as MoeRoutingStatistics
from qwen35_fs2.nn.moe.statistics import MoeStatistics as MoeStatistics
from qwen35_fs2.nn.moe.statistics import MoeStatisticsRecorder as MoeStatisticsRecorder
