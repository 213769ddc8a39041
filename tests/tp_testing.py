"""Builds Qwen3.5 models as one rank of a tensor-parallel gang would, on the
meta device, without processes: the gangs are fairseq2 fake gangs."""

from __future__ import annotations

import torch
from torch.nn import Module

from fairseq2.gang import FakeGang, Gangs, set_gangs

from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig

CPU = torch.device("cpu")


def fake_tp_gangs(tp_size: int, tp_rank: int = 0) -> Gangs:
    """Returns the gangs of rank ``tp_rank`` of a ``tp_size``-way tensor
    parallel world without data parallelism."""
    tp = FakeGang(CPU, rank=tp_rank, size=tp_size)

    single = FakeGang(CPU)

    return Gangs(root=tp, dp=single, rdp=single, sdp=single, tp=tp, pp=single)


def create_on_meta(config: Qwen35Config, gangs: Gangs) -> Module:
    """Creates the model of ``config`` on the meta device under ``gangs``,
    as fairseq2's model families do."""
    with torch.device("meta"), set_gangs(gangs, meta=True):
        if isinstance(config, Qwen35MoeConfig):
            return create_qwen35_moe_model(config)

        return create_qwen35_model(config)
