"""Pins what `qwen35_fs2.compat.dynamo_graphs` relies on: dynamo's counter
of compiled graphs counts the first compilation of a function and each
recompilation (here, of a second dtype)."""

from __future__ import annotations

import torch
from torch import Tensor

from qwen35_fs2.compat.dynamo_graphs import compiled_graph_count


def test_counts_the_first_compilation_and_each_recompilation() -> None:
    def double(x: Tensor) -> Tensor:
        return x * 2

    compiled = torch.compile(double, backend="eager")

    before = compiled_graph_count()

    compiled(torch.ones(3))

    assert compiled_graph_count() == before + 1

    # Cached: no new graph.
    compiled(torch.ones(3))

    assert compiled_graph_count() == before + 1

    # A guard fails: a recompilation.
    compiled(torch.ones(3, dtype=torch.float64))

    assert compiled_graph_count() == before + 2
