"""The benchmarks without tests of their own (``delta_rule.py``,
``lm_head_loss.py``, ``lora_memory.py``) as users run them, in
subprocesses, at a few tokens: they run to the end and report every variant.
Their numbers at these sizes mean nothing; what two implementations must
agree on (ours and the reference's trainable parameters, the weight
gradient's size) and what their ratios are made of is checked. One of them
stopped importing once when the code it shares with ``train_step.py``
moved."""

from __future__ import annotations

from typing import Any

import pytest

from benchmark_runner import read_report, run_benchmark_script

pytestmark = pytest.mark.slow


def _report(script: str, *options: str) -> dict[str, Any]:
    return read_report(run_benchmark_script(script, *options))


def test_delta_rule_reports_ours_and_the_reference() -> None:
    report = _report("delta_rule.py", "--seq-len=64", "--num-warmup=0", "--num-steps=1", "--rounds=1")

    assert report["config"]["seq_len"] == 64

    for variant in ("ours", "reference"):
        entry = report[variant]

        assert entry["fwd_bwd_ms"] >= entry["fwd_bwd_best_ms"] > 0

        assert entry["saved_for_backward_mib"] > 0

    assert report["speedup"] == pytest.approx(report["reference"]["fwd_bwd_ms"] / report["ours"]["fwd_bwd_ms"], rel=1e-2)


def test_lm_head_loss_reports_each_variant_against_the_floor() -> None:
    report = _report(
        "lm_head_loss.py", "--vocab-size=1024", "--model-dim=64", "--num-tokens=32", "--chunk-size=16",
        "--variants=ours,fairseq2,floor",
    )  # fmt: skip

    floor_ms = report["floor"]["fwd_bwd_ms"]

    for variant in ("ours", "fairseq2", "floor"):
        entry = report[variant]

        assert entry["fwd_bwd_ms"] > 0

        # bf16, 1024 x 64.
        assert entry["weight_grad_mib"] == pytest.approx(1024 * 64 * 2 / 2**20, abs=0.05)

        # The report rounds the fraction to 3 decimals, of the times it
        # reports (a relative bound fails on small fractions: 0.008 against
        # 0.00835).
        assert entry["fraction_of_floor"] == round(floor_ms / entry["fwd_bwd_ms"], 3)

    # Ours keeps two numbers a token for the backward pass.
    assert report["ours"]["saved_for_backward_mib"] < report["fairseq2"]["saved_for_backward_mib"]


def test_lora_memory_reports_ours_and_peft_with_the_same_adapters() -> None:
    report = _report("lora_memory.py", "--seq-len=16", "--num-warmup=0", "--num-steps=1")

    assert report["cpu"]["model_name"]

    full, lora = report["full"], report["lora"]

    for variant in ("ours", "reference"):
        # All parameters trainable in full fine-tuning, few with LoRA.
        assert full[variant]["trainable_params"] == full[variant]["params"]

        assert 0 < lora[variant]["trainable_params"] < full[variant]["trainable_params"] / 10

        # AdamW keeps two fp32 moments of every trainable parameter.
        assert lora[variant]["optimizer_state_mib"] == pytest.approx(
            2 * 4 * lora[variant]["trainable_params"] / 2**20, rel=1e-3
        )

    # Our adapters and PEFT's, on the same modules with the same rank.
    assert lora["ours"]["trainable_params"] == lora["reference"]["trainable_params"]

    assert full["ours"]["params"] == full["reference"]["params"]

    assert report["lora_over_full"]["ours"]["trainable_params"] == pytest.approx(
        lora["ours"]["trainable_params"] / full["ours"]["trainable_params"], rel=1e-3
    )
