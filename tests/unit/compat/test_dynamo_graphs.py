"""Pins what `qwen35_fs2.compat.dynamo_graphs` relies on: dynamo's counter
of compiled graphs counts the first compilation of a function and each
recompilation (here, of a second dtype), and its counter of graph breaks
counts a break at each compilation that meets it, by reason."""

from __future__ import annotations

import torch
from torch import Tensor

from qwen35_fs2.compat.dynamo_graphs import compiled_graph_count, graph_break_reasons


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


def test_counts_each_graph_break_once_per_compilation() -> None:
    def split(x: Tensor) -> Tensor:
        x = x + 1

        torch._dynamo.graph_break()

        return x * 2

    compiled = torch.compile(split, backend="eager")

    def count() -> int:
        return graph_break_reasons().get("Call to `torch._dynamo.graph_break()`", 0)

    before = count()

    compiled(torch.ones(3))

    assert count() == before + 1

    # Cached: not compiled again.
    compiled(torch.ones(3))

    assert count() == before + 1

    # A recompilation meets the break again.
    compiled(torch.ones(3, dtype=torch.float64))

    assert count() == before + 2
