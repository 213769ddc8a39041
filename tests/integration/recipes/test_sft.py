from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qwen35_fs2.datasets.synthetic import generate_synthetic_gsm8k
from qwen35_fs2.recipes.resume import RESTORED_CONFIG_FILE

from recipe_runner import TINY_MODEL_OVERRIDES, read_metrics, run_recipe

CONFIG = "qwen35_tiny_gsm8k_cpu.yaml"

# 6 steps of one or two packed examples, a constant learning rate (so that the
# schedule does not depend on `num_steps`), no validation (the config holds out
# training examples for it).
OVERRIDES = (
    TINY_MODEL_OVERRIDES,
    "dataset.max_seq_len=256",
    "dataset.max_num_tokens=256",
    "dataset.num_held_out_examples=0",
    "lr_scheduler.config={num_warmup_steps: 0, cycle_len: 100, final_lr_scale: 1.0}",
    "regime.num_steps=6",
    "regime.checkpoint_every_n_steps=3",
    "regime.keep_last_n_checkpoints=null",
    "regime.validate_every_n_steps=null",
)


# The steps of the compiled two-process run.
COMPILED_STEPS = 3


@pytest.mark.slow
class TestInstructionFinetuneCPU:
    def test_loss_decreases_and_a_resumed_run_matches_an_uninterrupted_one(self, tmp_path: Path) -> None:
        full_dir = tmp_path / "full"

        run_recipe("instruction_finetune", full_dir, CONFIG, OVERRIDES)

        full = read_metrics(full_dir)

        losses = [full[step]["NLL Loss"] for step in range(1, 7)]

        assert losses[-1] < losses[0] - 0.5, losses

        # The run's checkpoint of step 3 (model, optimizer, data reader) and
        # the record of its settings, as a run stopped then would find them,
        # resumed in another directory to step 6.
        resumed_dir = tmp_path / "resumed"

        shutil.copytree(full_dir / "checkpoints" / "step_3", resumed_dir / "checkpoints" / "step_3")

        shutil.copy(full_dir / "checkpoints" / RESTORED_CONFIG_FILE, resumed_dir / "checkpoints")

        # Another learning rate and weight decay would be replaced by the
        # checkpoint's: refused before training, naming each.
        process = run_recipe(
            "instruction_finetune", resumed_dir, CONFIG, [*OVERRIDES, "optimizer.config.lr=2.0e-3", "optimizer.config.weight_decay=0.05"], expected_returncode=2
        )

        assert "`optimizer.config.lr` must be 0.003, but is 0.002 instead; `optimizer.config.weight_decay` must be 0.1, but is 0.05 instead." in process.stdout

        assert not (resumed_dir / "metrics" / "train.jsonl").exists()

        # A stop requested before the first step (the SLURM launcher's stop
        # file, there before the run starts) stops the run after its restore,
        # without a step or a checkpoint.
        stop_file = tmp_path / "stop-request"

        stop_file.touch()

        process = run_recipe("instruction_finetune", resumed_dir, CONFIG, OVERRIDES, env={"QWEN35_STOP_FILE": str(stop_file)})

        assert "Training restored. Resuming from step 3." in process.stdout, process.stdout[-3000:]

        assert "A stop was requested before the first step: stopping without training and without a checkpoint." in process.stdout

        assert not (resumed_dir / "metrics" / "train.jsonl").exists()

        assert sorted(path.name for path in (resumed_dir / "checkpoints").glob("step_*")) == ["step_3"]

        process = run_recipe("instruction_finetune", resumed_dir, CONFIG, OVERRIDES)

        assert "Resuming from step 3." in process.stdout

        resumed = read_metrics(resumed_dir)

        assert sorted(resumed) == [4, 5, 6]

        for step in range(4, 7):
            assert resumed[step]["NLL Loss"] == pytest.approx(full[step]["NLL Loss"], abs=1e-6), step

    def test_two_processes_train_with_fsdp2_validate_on_jsonl_and_train_alike_compiled(self, tmp_path: Path) -> None:
        # fairseq2's src/tgt layout, as in facebook/fairseq2-lm-gsm8k.
        valid_file = tmp_path / "valid.jsonl"

        with valid_file.open("w", encoding="utf-8") as fp:
            for example in generate_synthetic_gsm8k(6, seed=9):
                fp.write(json.dumps({"src": example.question, "tgt": example.answer}) + "\n")

        output_dir = tmp_path / "out"

        overrides = [
            *OVERRIDES,
            f"dataset.valid=[{{path: {valid_file}}}]",
            "regime.validate_every_n_steps=6",
        ]

        run_recipe("instruction_finetune", output_dir, CONFIG, overrides, nproc=2)

        train = read_metrics(output_dir)

        assert train[6]["NLL Loss"] < train[1]["NLL Loss"] - 0.5

        # Both ranks' examples count: two packed batches per step.
        assert train[1]["Number of Examples"] >= 2

        valid = read_metrics(output_dir, "valid")

        assert valid[6]["Number of Examples"] == 6

        assert output_dir.joinpath("checkpoints", "step_6", "model").is_dir()

        # `model.compile: true` under FSDP2, as a multi-GPU run would set it:
        # the same first steps (the second one compiles its graphs again with
        # the tokens dynamic, and a parameter the graphs held stale from an
        # earlier step would show from the second on). The gradients' norm
        # too: AdamW's steps do not change when all gradients are scaled
        # alike, so the losses alone miss a gradient that is, say, 1% too
        # large (they did, with the compiled loss's gradients scaled so).
        # With `aot_eager`: dynamo and AOTAutograd, where FSDP2's modules and
        # parameters meet the compiler, without inductor's C++ (test_compile.py
        # runs that on one process); inductor took about 90 s more here.
        # Measured with inductor: losses and norms at most 1e-6 apart
        # (relative) over 8 steps; with `aot_eager`, 7e-8 over 3.
        compiled_dir = tmp_path / "compiled"

        compile_overrides = ["model.compile=true", "model.compile_options.backend=aot_eager", f"regime.num_steps={COMPILED_STEPS}"]

        run_recipe("instruction_finetune", compiled_dir, CONFIG, [*overrides, *compile_overrides], nproc=2)

        compiled = read_metrics(compiled_dir)

        assert sorted(compiled) == list(range(1, COMPILED_STEPS + 1))

        assert compiled[1]["Compiled Graphs"] > 0

        for step in compiled:
            for name in ("NLL Loss", "Gradient Norm"):
                assert compiled[step][name] == pytest.approx(train[step][name], rel=1e-5), (step, name)

    def test_validates_on_held_out_training_examples_and_trains_on_the_others(self, tmp_path: Path) -> None:
        train_file = tmp_path / "train.jsonl"

        with train_file.open("w", encoding="utf-8") as fp:
            for example in generate_synthetic_gsm8k(12, seed=9):
                fp.write(json.dumps({"question": example.question, "answer": example.answer}) + "\n")

        output_dir = tmp_path / "out"

        # One epoch, then a validation at its end.
        overrides = [
            *OVERRIDES,
            f"dataset.train=[{{path: {train_file}}}]",
            "dataset.num_held_out_examples=4",
            "regime.num_steps=100",
            "regime.num_data_epochs=1",
        ]

        process = run_recipe("instruction_finetune", output_dir, CONFIG, overrides)

        train = read_metrics(output_dir)

        assert sum(record["Number of Examples"] for record in train.values()) == 8

        valid = read_metrics(output_dir, "valid")

        assert [record["Number of Examples"] for record in valid.values()] == [4]

        assert "Held out 4 of the 12 training examples for validation." in process.stdout

    def test_a_nan_loss_stops_both_processes_with_a_clear_error(self, tmp_path: Path) -> None:
        # An absurd learning rate turns the weights, then the loss, into NaN.
        overrides = [*OVERRIDES, "optimizer.config.lr=1e30", "trainer.max_grad_norm=null"]

        process = run_recipe("instruction_finetune", tmp_path / "out", CONFIG, overrides, nproc=2, expected_returncode=1)

        assert "The loss of a training batch is nan at step" in process.stdout

        # Neither rank hung: torchrun reports the failed ranks and returns.
        assert "ChildFailedError" in process.stdout
