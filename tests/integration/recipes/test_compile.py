"""`model.compile: true` (inductor) in `lm instruction_finetune` on packed
batches, whose widths and documents change every step: the compiled run
trains as the eager one and compiles new graphs only where a packing first
has another number of tokens or of documents and after the first
validation, with the count of compiled graphs in its metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipe_runner import TINY_MODEL_OVERRIDES, read_metrics, run_recipe

CONFIG = "qwen35_tiny_gsm8k_cpu.yaml"

NUM_STEPS = 16

# A validation after step 8 and one at the end.
VALIDATE_EVERY = 8

# Packs of whole examples of up to 256 tokens (one or two examples), a
# validation every 8 steps on 8 held-out training examples (the config's 32
# were a third of the eager run on the slow test machine: the logits of the
# real vocabulary; 8 are still batches of several widths), a constant
# learning rate.
OVERRIDES = (
    TINY_MODEL_OVERRIDES,
    "dataset.max_seq_len=256",
    "dataset.max_num_tokens=256",
    "dataset.num_held_out_examples=8",
    "lr_scheduler.config={num_warmup_steps: 0, cycle_len: 100, final_lr_scale: 1.0}",
    f"regime.num_steps={NUM_STEPS}",
    f"regime.validate_every_n_steps={VALIDATE_EVERY}",
    "regime.checkpoint_every_n_steps=100",
)

# Measured: the compiled run's losses differ from the eager run's by at
# most 1.3e-7 (relative) over the first 25 steps of a 50-step run, fp32
# rounding (inductor fuses and reorders the elementwise work), which training
# then amplifies (3e-5 and 2.3e-4 by step 50 in two runs); a wrong gradient
# or a document boundary that leaks moves the first steps' losses by orders
# of magnitude more.
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
    assert len(widths) > NUM_STEPS // 2, widths

    for step in range(1, NUM_STEPS + 1):
        rtol = EARLY_LOSS_RTOL if step <= VALIDATE_EVERY else LATE_LOSS_RTOL

        # The gradients' norm too: AdamW's steps (and clipping) do not change
        # when all gradients are scaled alike, so the losses alone miss a
        # gradient that is, say, 1% too large.
        for name in ("NLL Loss", "Gradient Norm"):
            assert compiled[step][name] == pytest.approx(eager[step][name], rel=rtol), (step, name)

    eager_valid, compiled_valid = read_metrics(eager_dir, "valid"), read_metrics(compiled_dir, "valid")

    for step, rtol in ((VALIDATE_EVERY, EARLY_LOSS_RTOL), (NUM_STEPS, LATE_LOSS_RTOL)):
        assert compiled_valid[step]["NLL Loss"] == pytest.approx(eager_valid[step]["NLL Loss"], rel=rtol)

    assert "Compiled Graphs" not in eager[1]

    graphs = _assert_compiles_only_for_new_packings(eager, compiled)

    # Each step that compiled graphs says so in the log.
    compile_logs = [line for line in process.stdout.splitlines() if "torch.compile compiled" in line]

    assert len(compile_logs) == len(set(graphs)), compile_logs

    assert f"({graphs[-1]} in all)" in compile_logs[-1]

    # Packed batches: the attention mask is made before the compiled layers.
    assert all(compiled[step]["Graph Breaks"] == 0 for step in compiled), [compiled[step]["Graph Breaks"] for step in compiled]

    assert "graph break" not in process.stdout


# Dense: two Gated DeltaNet and two attention layers, and an MTP head, whose
# attention layer runs in the compiled loss and makes its mask there (one
# case for both: the suite's time); MoE: the same layers with MoE blocks,
# whose routing statistics the layers return.
_AC_MODELS = {
    "dense": ("model.config_overrides={num_layers: 4, full_attention_interval: 2, model_dim: 64, ffn_inner_dim: 128, mtp_num_layers: 1}",),
    "moe": (
        "model.family=qwen35_moe",
        "model.arch=qwen35_moe_tiny",
        "model.config_overrides={vocab_size: 248320, pad_idx: 248044, num_layers: 4, full_attention_interval: 2}",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(_AC_MODELS))
def test_compiled_checkpointed_packed_sft_has_no_graph_break(tmp_path: Path, model: str) -> None:
    # Under activation checkpointing a graph break inside a layer runs the
    # whole layer eagerly: the attention mask of packed batches and the MoE
    # routing statistics did, which left those layers uncompiled. Dynamo and
    # AOTAutograd (`aot_eager`), where the breaks are decided, without
    # inductor's code generation.
    num_steps = 4

    overrides = [
        *OVERRIDES[1:],
        *_AC_MODELS[model],
        f"regime.num_steps={num_steps}",
        "trainer.activation_checkpointing={mode: layerwise}",
    ]

    eager_dir, compiled_dir = tmp_path / "eager", tmp_path / "compiled"

    run_recipe("instruction_finetune", eager_dir, CONFIG, overrides)

    process = run_recipe(
        "instruction_finetune", compiled_dir, CONFIG,
        [*overrides, "model.compile=true", "model.compile_options={backend: aot_eager}"],
    )  # fmt: skip

    eager, compiled = read_metrics(eager_dir), read_metrics(compiled_dir)

    assert sorted(compiled) == list(range(1, num_steps + 1))

    assert all(compiled[step]["Graph Breaks"] == 0 for step in compiled), process.stdout[-3000:]

    # The loss the model adds to the NLL loss, in training and validation.
    model_losses = {"dense": ["MTP Loss"], "moe": ["Auxiliary Loss"]}[model]

    names = ["NLL Loss", "Gradient Norm", *model_losses]

    errors = {(step, name): abs(compiled[step][name] / eager[step][name] - 1) for step in compiled for name in names}

    # Measured: up to 1.3e-6 (the dense model's gradient norm at step 2),
    # fp32 rounding; a layer that leaks across documents or loses a
    # gradient is off by far more.
    assert max(errors.values()) < 1e-5, errors

    # The validation at the end of training (fairseq2 validates then), on
    # graphs compiled without gradients: for the dense model the MTP head's
    # loss and its acceptance of greedy drafts, which only validation
    # measures. Measured (dense): the losses 2.0e-8 apart, relative, the
    # acceptance equal.
    eager_valid, compiled_valid = read_metrics(eager_dir, "valid")[num_steps], read_metrics(compiled_dir, "valid")[num_steps]

    valid_errors = {name: abs(compiled_valid[name] / eager_valid[name] - 1) for name in ["NLL Loss", *model_losses]}

    # A fraction of the drafts, which may be 0: compared absolutely.
    if model == "dense":
        valid_errors["MTP Acceptance"] = abs(compiled_valid["MTP Acceptance"] - eager_valid["MTP Acceptance"])

    assert max(valid_errors.values()) < 1e-5, valid_errors


def _assert_compiles_only_for_new_packings(eager: dict[int, dict[str, float]], compiled: dict[int, dict[str, float]]) -> list[int]:
    """Asserts that the compiled run compiled graphs at step 1 and then only
    at the steps the packings and the validation explain; returns the count
    of compiled graphs at every step.

    Step 1 compiles the graphs of its packing. The first step with another
    number of tokens compiles them again with that size dynamic, and the
    first with another number of documents (examples: each is one document)
    compiles the Gated DeltaNet layers with that one dynamic too; the
    validation after step ``VALIDATE_EVERY`` compiles the graphs without
    gradients (seen at the next step). No other step compiles anything: a
    packing of sizes seen or not seen before reuses the graphs. Which steps
    are first is the data's (measured: the token count changes at step 2,
    the document count at step 14, whose pack is one example).
    """
    graphs = [int(compiled[step]["Compiled Graphs"]) for step in range(1, NUM_STEPS + 1)]

    def first_change(name: str) -> set[int]:
        steps = [step for step in range(2, NUM_STEPS + 1) if eager[step][name] != eager[1][name]]

        return set(steps[:1])

    expected = first_change("Elements per Batch") | first_change("Number of Examples") | {VALIDATE_EVERY + 1}

    growths = {step for step in range(2, NUM_STEPS + 1) if graphs[step - 1] > graphs[step - 2]}

    assert growths == expected, graphs

    return graphs
