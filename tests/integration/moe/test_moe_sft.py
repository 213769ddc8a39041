"""``lm instruction_finetune`` of a tiny Qwen3.5-MoE model on CPU: two
``torchrun`` processes (gloo, FSDP2) train like one process accumulating the
same two examples per step, with the load-balancing loss and the expert-load
metrics, and validate like it; so do two processes with expert parallelism,
also while one of them validates alone."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from integration.recipes.recipe_runner import read_metrics, run_recipe
from qwen35_fs2.recipes.resume import RESTORED_CONFIG_FILE
from scratch import scratch_dir

CONFIG = "qwen35_tiny_gsm8k_cpu.yaml"

# A 2-layer (Gated DeltaNet + attention) MoE over the real vocabulary, 8
# experts top-2; one example per padded batch, so that a step of two ranks
# and a step of two accumulated batches see the same examples. Validation
# after steps 3 and 6 on 3 held-out examples: on two ranks, 2 batches on one
# and 1 on the other, so that one rank validates alone for a step (under
# expert parallelism, the other must still take part in its exchanges).
OVERRIDES = (
    "model.family=qwen35_moe",
    "model.arch=qwen35_moe_tiny",
    "model.config_overrides={vocab_size: 248320, pad_idx: 248044, num_layers: 2, full_attention_interval: 2}",
    "dataset.max_seq_len=256",
    "dataset.max_num_tokens=256",
    "dataset.packing=false",
    "dataset.batch_size=1",
    "dataset.valid=[]",
    "dataset.num_held_out_examples=3",
    "lr_scheduler.config={num_warmup_steps: 0, cycle_len: 100, final_lr_scale: 1.0}",
    "loss.aux_loss_weight=0.01",
    "regime.num_steps=6",
    "regime.checkpoint_every_n_steps=3",
    "regime.keep_last_n_checkpoints=2",
    "regime.validate_every_n_steps=3",
)

_NUM_STEPS = 6

_VALID_STEPS = (3, 6)


@pytest.fixture(scope="module")
def fsdp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 2-process FSDP2 run, checkpointed at steps 3 and 6."""
    with scratch_dir(tmp_path_factory, "fsdp") as output_dir:
        run_recipe("instruction_finetune", output_dir, CONFIG, OVERRIDES, nproc=2)

        yield output_dir


@pytest.mark.slow
def test_two_fsdp2_processes_train_like_one_accumulating_process(tmp_path: Path, fsdp_dir: Path) -> None:
    single_dir = tmp_path / "single"

    run_recipe("instruction_finetune", single_dir, CONFIG, [*OVERRIDES, "trainer.grad_accumulation.num_batches=2"])

    single, fsdp = read_metrics(single_dir), read_metrics(fsdp_dir)

    losses = [fsdp[step]["NLL Loss"] for step in range(1, _NUM_STEPS + 1)]

    assert losses[-1] < losses[0] - 0.5, f"The loss must fall, but went {losses}."

    for step in range(1, _NUM_STEPS + 1):
        assert fsdp[step]["Number of Examples"] == single[step]["Number of Examples"] == 2

        assert fsdp[step]["NLL Loss"] == pytest.approx(single[step]["NLL Loss"], rel=1e-4), step

        assert fsdp[step]["Auxiliary Loss"] == pytest.approx(single[step]["Auxiliary Loss"], rel=1e-4), step

        # The losses alone would miss gradients reduced over the processes
        # with another scale (a sum for a mean): AdamW's steps and clipping
        # do not change when all gradients are scaled alike.
        assert fsdp[step]["Gradient Norm"] == pytest.approx(single[step]["Gradient Norm"], rel=1e-4), step

        # The loss is `E * sum_e f_e * P_e` (f_e: the assignments to expert
        # e per token, summing to top-k; P_e: its mean routing probability).
        # The router starts near uniform (weights of std 0.02) and moves
        # little in six steps, so every P_e stays close to 1/E and the loss
        # close to top-k = 2, however unevenly the tokens fall. A missing
        # factor E (0.25), a sum over the two layers (4) or f summing to 1
        # (1) is far off.
        assert fsdp[step]["Auxiliary Loss"] == pytest.approx(2.0, abs=0.1), step

        assert fsdp[step]["Dropped Expert Assignments"] == 0

        assert fsdp[step]["Most Tokens of an Expert"] >= fsdp[step]["Fewest Tokens of an Expert"]

    assert fsdp_dir.joinpath("checkpoints", f"step_{_NUM_STEPS}", "model").is_dir()

    _assert_validations_equal(fsdp_dir, single_dir, _VALID_STEPS, rel=1e-4)


def _assert_steps_equal(run: dict[int, dict[str, float]], expected: dict[int, dict[str, float]], steps: range) -> None:
    for step in steps:
        for name in ("NLL Loss", "Auxiliary Loss", "Gradient Norm", "Number of Examples"):
            assert run[step][name] == pytest.approx(expected[step][name], rel=1e-5), f"step {step}: {name}"


def _assert_validations_equal(run_dir: Path, expected_dir: Path, steps: tuple[int, ...], *, rel: float) -> None:
    """Asserts that the run of ``run_dir`` validated all 3 held-out examples
    after ``steps`` with the losses of the run of ``expected_dir``."""
    run, expected = read_metrics(run_dir, "valid"), read_metrics(expected_dir, "valid")

    assert sorted(run) == list(steps)

    for step in steps:
        assert run[step]["Number of Examples"] == expected[step]["Number of Examples"] == 3, step

        assert run[step]["NLL Loss"] == pytest.approx(expected[step]["NLL Loss"], rel=rel), step


@pytest.mark.slow
def test_expert_parallel_run_trains_and_resumes_like_fsdp2(tmp_path: Path, fsdp_dir: Path) -> None:
    fsdp = read_metrics(fsdp_dir)

    # From scratch: rank 0's new model, its experts split over the two ranks.
    ep_dir = tmp_path / "ep"

    run_recipe("instruction_finetune", ep_dir, CONFIG, [*OVERRIDES, "gang.expert_parallel_size=2"], nproc=2)

    ep = read_metrics(ep_dir)

    losses = [ep[step]["NLL Loss"] for step in range(1, _NUM_STEPS + 1)]

    assert losses[-1] < losses[0] - 0.5, f"The loss must fall, but went {losses}."

    _assert_steps_equal(ep, fsdp, range(1, _NUM_STEPS + 1))

    _assert_validations_equal(ep_dir, fsdp_dir, _VALID_STEPS, rel=1e-5)

    # The FSDP2 run's step-3 checkpoint (model, optimizer, data reader),
    # resumed at EP size 2.
    resumed_dir = tmp_path / "resumed"

    shutil.copytree(fsdp_dir / "checkpoints" / "step_3", resumed_dir / "checkpoints" / "step_3")

    shutil.copy(fsdp_dir / "checkpoints" / RESTORED_CONFIG_FILE, resumed_dir / "checkpoints")

    run_recipe("instruction_finetune", resumed_dir, CONFIG, [*OVERRIDES, "gang.expert_parallel_size=2"], nproc=2)

    resumed = read_metrics(resumed_dir)

    assert sorted(resumed) == [4, 5, 6]

    _assert_steps_equal(resumed, fsdp, range(4, _NUM_STEPS + 1))

    _assert_validations_equal(resumed_dir, fsdp_dir, (6,), rel=1e-5)

    # Its checkpoint holds each rank's shards as the FSDP2 run's does.
    for rank in range(2):
        shard = Path("model", "pp_00", "tp_00", f"sdp_{rank:02d}.pt")

        expected = torch.load(fsdp_dir / "checkpoints" / "step_6" / shard)

        state_dict = torch.load(resumed_dir / "checkpoints" / "step_6" / shard)

        assert state_dict.keys() == expected.keys()

        for key, value in expected.items():
            torch.testing.assert_close(state_dict[key], value, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ep_size", "message"),
    [
        # A size the config refuses (0) is tests/unit/recipes/test_configs.py's.
        (2, "`gang.expert_parallel_size` (2) cannot be used: The expert parallel size must be a positive divisor of the data parallel size (1), but is 2 instead."),
    ],
)
def test_bad_expert_parallel_size_is_a_clear_error(ep_size: int, message: str, tmp_path: Path) -> None:
    output_dir = tmp_path / "out"

    process = run_recipe(
        "instruction_finetune", output_dir, CONFIG, [*OVERRIDES, f"gang.expert_parallel_size={ep_size}"], expected_returncode=2
    )

    assert message in process.stdout

    # Stopped before training.
    assert not (output_dir / "metrics").exists()


@pytest.mark.slow
def test_ddp_trains_the_mtp_head_of_a_moe_model(tmp_path: Path) -> None:
    # fairseq2 wraps the model in DDP looking for unused parameters unless
    # the recipe says its autograd graph is static; the MTP loss leaves the
    # forward pass beside its output, where DDP does not look, so a MoE
    # model with a head failed its first backward pass ("mark a variable
    # ready only once"). Every parameter of a MoE model gets a gradient at
    # every step: the graph is static.
    output_dir = tmp_path / "ddp"

    overrides = [
        *OVERRIDES,
        "model.config_overrides={vocab_size: 248320, pad_idx: 248044, num_layers: 2, full_attention_interval: 2, mtp_num_layers: 1}",
        "trainer.data_parallelism=ddp",
        "loss.mtp_loss_weight=0.5",
    ]

    run_recipe("instruction_finetune", output_dir, CONFIG, overrides, nproc=2)

    metrics = read_metrics(output_dir)

    for name in ("NLL Loss", "MTP Loss"):
        losses = [metrics[step][name] for step in range(1, _NUM_STEPS + 1)]

        assert losses[-1] < losses[0] - 0.5, f"The {name} must fall, but went {losses}."
