"""SFT trains the MTP head with the model: its loss is reported as its own
metric, in training and validation, and falls, and validation measures
the head's acceptance; with FSDP2 over two processes (the head in the root
unit, its loss in the model's forward pass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen35_fs2.datasets.synthetic import generate_synthetic_gsm8k

from recipe_runner import read_metric_records, read_metrics, run_recipe

CONFIG = "qwen35_tiny_gsm8k_cpu.yaml"

OVERRIDES = (
    "model.config_overrides={num_layers: 2, full_attention_interval: 2, model_dim: 64, ffn_inner_dim: 128, mtp_num_layers: 1}",
    "dataset.max_seq_len=256",
    "dataset.max_num_tokens=256",
    "dataset.num_held_out_examples=0",
    "lr_scheduler.config={num_warmup_steps: 0, cycle_len: 100, final_lr_scale: 1.0}",
    "regime.num_steps=6",
    "regime.checkpoint_every_n_steps=6",
    "regime.validate_every_n_steps=6",
)


@pytest.mark.slow
def test_sft_trains_the_mtp_head_with_fsdp2_and_reports_its_loss(tmp_path: Path) -> None:
    valid_file = tmp_path / "valid.jsonl"

    with valid_file.open("w", encoding="utf-8") as fp:
        for example in generate_synthetic_gsm8k(4, seed=9):
            fp.write(json.dumps({"src": example.question, "tgt": example.answer}) + "\n")

    output_dir = tmp_path / "out"

    run_recipe("instruction_finetune", output_dir, CONFIG, [*OVERRIDES, f"dataset.valid=[{{path: {valid_file}}}]"], nproc=2)

    train = read_metrics(output_dir)

    assert train[6]["MTP Loss"] < train[1]["MTP Loss"] - 0.5, [train[s]["MTP Loss"] for s in sorted(train)]

    assert train[6]["NLL Loss"] < train[1]["NLL Loss"] - 0.5

    valid = read_metrics(output_dir, "valid")

    assert valid[6]["MTP Loss"] > 0.0

    # Measured in validation only.
    assert 0.0 <= valid[6]["MTP Acceptance"] <= 1.0

    assert "MTP Acceptance" not in train[6]


@pytest.mark.slow
def test_the_mtp_loss_raises_the_acceptance_of_the_head_over_a_frozen_one(tmp_path: Path) -> None:
    valid_file = tmp_path / "valid.jsonl"

    with valid_file.open("w", encoding="utf-8") as fp:
        for example in generate_synthetic_gsm8k(8, seed=9):
            fp.write(json.dumps({"src": example.question, "tgt": example.answer}) + "\n")

    acceptance = {}

    for weight in (0.0, 0.1):
        output_dir = tmp_path / f"w{weight}"

        overrides = [*OVERRIDES, f"dataset.valid=[{{path: {valid_file}}}]", f"loss.mtp_loss_weight={weight}", "regime.num_steps=12", "regime.validate_every_n_steps=12", "regime.checkpoint_every_n_steps=12"]

        run_recipe("instruction_finetune", output_dir, CONFIG, overrides)

        acceptance[weight] = read_metrics(output_dir, "valid")[12]["MTP Acceptance"]

    print(f"MTP acceptance on held-out examples after 12 SFT steps: {acceptance}")

    assert acceptance[0.1] > acceptance[0.0] + 0.05, acceptance

    # The trained head drafts for speculative decoding of test questions,
    # compared with plain greedy decoding in the same run.
    eval_dir = tmp_path / "eval"

    run_recipe(
        "eval_gsm8k",
        eval_dir,
        "qwen35_tiny_gsm8k_eval_cpu.yaml",
        [
            "model.name=last_checkpoint",
            f"common.assets.prev_checkpoint_dir={tmp_path / 'w0.1' / 'checkpoints'}",
            "common.no_sweep_dir=true",
            "dataset.max_num_examples=4",
            "seq_generator.config.max_gen_len=64",
            "speculative_decoding.enabled=true",
        ],
    )

    [values] = read_metric_records(eval_dir, "generation")

    print(
        "Speculative decoding of 4 test questions: acceptance {Speculative Acceptance:.2f}, "
        "{Speculative Tokens per Second} vs {Plain Greedy Tokens per Second} tokens/s plain "
        "(speed-up {Speculative Speed-up:.2f})".format(**values)
    )

    assert values["Speculative Mismatches"] == 0

    # Lower than on the references of validation (the greedy responses of a
    # 12-step model are not its training data), far above a frozen head's.
    assert values["Speculative Acceptance"] > 0.25, values
