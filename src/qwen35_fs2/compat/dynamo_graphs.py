"""Workaround: the number of graphs ``torch.compile`` has compiled, and of
the graph breaks it has met.

PyTorch 2.9 has no public count of dynamo's compilations (or
recompilations) or graph breaks; its ``TORCH_LOGS=recompiles`` and
``TORCH_LOGS=graph_breaks`` log them but count nothing. Dynamo increments
``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` for every graph it
compiles, the first ones and each recompilation alike, and
``counters["graph_break"][reason]`` for every graph break it compiles around
(once per compilation, not per call). The recipes report both as the
metrics ``compiled_graphs`` and ``graph_breaks``, so that a run that keeps
recompiling, or whose layers fall back to eager mode in part (under
activation checkpointing, a graph break runs the whole layer eagerly),
shows it. ``tests/unit/compat/test_dynamo_graphs.py`` fails if the counters
go away or stop counting.
"""

from __future__ import annotations


def compiled_graph_count() -> int:
    """Returns how many graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_break_reasons() -> dict[str, int]:
    """Returns the first line of the reason of every graph break dynamo has
    compiled around in this process, with how many times it did."""
    from torch._dynamo.utils import counters

    reasons: dict[str, int] = {}

    for reason, count in counters["graph_break"].items():
        first_line = str(reason).strip().splitlines()[0] if str(reason).strip() else "(no reason given)"

        reasons[first_line] = reasons.get(first_line, 0) + int(count)

    return reasons
