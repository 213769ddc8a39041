"""`model.compile: true` (inductor) in `lm instruction_finetune` on packed
batches, whose widths and documents change every step: the compiled run
trains as the eager one and stops compiling new graphs once it has seen both
a second packing and a validation, with the count of compiled graphs in its
metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipe_runner import TINY_MODEL_OVERRIDES, read_metrics, run_recipe

CONFIG = "qwen35_tiny_gsm8k_cpu.yaml"

NUM_STEPS = 50

# Packs of whole examples of up to 256 tokens (one or two examples), the
# config's held-out validation every 25 steps, a constant learning rate.
OVERRIDES = (
    TINY_MODEL_OVERRIDES,
    "dataset.max_seq_len=256",
    "dataset.max_num_tokens=256",
    "lr_scheduler.config={num_warmup_steps: 0, cycle_len: 100, final_lr_scale: 1.0}",
    f"regime.num_steps={NUM_STEPS}",
    "regime.validate_every_n_steps=25",
    "regime.checkpoint_every_n_steps=100",
)

# Measured: the compiled run's losses differ from the eager run's by at
# most 1.3e-7 (relative) over the first 25 steps, fp32 rounding (inductor
# fuses and reorders the elementwise work), which training then amplifies
# (3e-5 and 2.3e-4 by step 50 in two runs); a wrong gradient or a document
# boundary that leaks moves the first steps' losses by orders of magnitude
# more.
EARLY_LOSS_RTOL, LATE_LOSS_RTOL = 1e-6, 3e-3


@pytest.mark.slow
def test_compiled_packed_sft_matches_eager_and_stops_recompiling(tmp_path: Path) -> None:
    eager_dir, compiled_dir = tmp_path / "eager", tmp_path / "compiled"

    run_recipe("instruction_finetune", eager_dir, CONFIG, OVERRIDES)

    process = run_recipe("instruction_finetune", compiled_dir, CONFIG, [*OVERRIDES, "model.compile=true"])

    eager, compiled = read_metrics(eager_dir), read_metrics(compiled_dir)

    assert sorted(compiled) == list(range(1, NUM_STEPS + 1))

    widths = {eager[step]["Elements per Batch"] for step in eager}

    # Else the test would not test recompilation.
    assert len(widths) > 10, widths

    for step in range(1, NUM_STEPS + 1):
        rtol = EARLY_LOSS_RTOL if step <= 25 else LATE_LOSS_RTOL

        assert compiled[step]["NLL Loss"] == pytest.approx(eager[step]["NLL Loss"], rel=rtol), step

    eager_valid, compiled_valid = read_metrics(eager_dir, "valid"), read_metrics(compiled_dir, "valid")

    for step, rtol in ((25, EARLY_LOSS_RTOL), (50, LATE_LOSS_RTOL)):
        assert compiled_valid[step]["NLL Loss"] == pytest.approx(eager_valid[step]["NLL Loss"], rel=rtol)

    assert "Compiled Graphs" not in eager[1]

    graphs = [int(compiled[step]["Compiled Graphs"]) for step in range(1, NUM_STEPS + 1)]

    # Step 1 compiles the graphs of its packing. The first step with another
    # number of tokens compiles them again with that size dynamic, and the
    # first with another number of documents compiles the Gated DeltaNet
    # layers with that one dynamic too; inductor may compile a graph once
    # more for another range of sizes (measured: the loss, for 128 tokens or
    # fewer, while it broke into three graphs; as one graph it does not). The validation at step 25 compiles the graphs without
    # gradients (seen at step 26). Then no packing compiles anything: no
    # recompilation from step 27 to step 50, through the second validation.
    growths = [step for step in range(2, 26) if graphs[step - 1] > graphs[step - 2]]

    # Another token count within the first 25 steps.
    assert len(growths) >= 1, graphs

    assert len(growths) <= 4, graphs

    assert set(graphs[25:]) == {graphs[25]}, graphs

    # Each step that compiled graphs says so in the log.
    compile_logs = [line for line in process.stdout.splitlines() if "torch.compile compiled" in line]

    assert len(compile_logs) == len(set(graphs)), compile_logs

    assert f"({graphs[-1]} in all)" in compile_logs[-1]
