"""Workaround: the number of graphs ``torch.compile`` has compiled.

PyTorch 2.9 has no public count of dynamo's compilations (or
recompilations); its ``TORCH_LOGS=recompiles`` logs their reasons but counts
nothing. Dynamo increments ``torch._dynamo.utils.counters["stats"]
["unique_graphs"]`` for every graph it compiles, the first ones and each
recompilation alike; the recipes report it as the metric ``compiled_graphs``
so that a run that keeps recompiling shows it.
``tests/unit/compat/test_dynamo_graphs.py`` fails if the counter goes away
or stops counting recompilations.
"""

from __future__ import annotations


def compiled_graph_count() -> int:
    """Returns how many graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
