"""``benchmarks/layer_overhead.py`` as users run it, in a subprocess, at a few
tokens: its report covers every kind of module of the model, and its numbers
add up."""

from __future__ import annotations

import pytest

from benchmark_runner import read_report, run_benchmark_script


@pytest.mark.slow
def test_reports_each_module_and_its_gemms() -> None:
    report = read_report(
        run_benchmark_script("layer_overhead.py", "--seq-len=32", "--num-warmup=1", "--num-steps=2", "--rounds=2")
    )

    assert report["config"]["seq_len"] == 32 and report["rounds"] == 2 and report["cpu"]["model_name"]

    modules = report["modules"]

    assert list(modules) == ["gdn", "attention", "ffn", "norm"]

    # The reference config: 8 layers, every 4th full attention.
    counts = {name: entry["count"] for name, entry in modules.items()}

    assert counts == {"gdn": 6, "attention": 2, "ffn": 8, "norm": 17}

    for name, entry in modules.items():
        assert entry["median_ms"] >= entry["best_ms"] > 0

        # Only the norm has no projection.
        assert (entry["gemm_ms"] > 0) == (name != "norm")

        assert entry["overhead_ms"] == pytest.approx(entry["best_ms"] - entry["gemm_ms"], abs=0.011)

        # Rounded from the unrounded overhead.
        assert entry["overhead_per_step_ms"] == pytest.approx(entry["count"] * entry["overhead_ms"], abs=0.15)
