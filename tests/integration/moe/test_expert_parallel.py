"""Expert parallelism on 2 and 4 CPU processes (gloo): the logits, loss,
load-balancing loss and every gradient of a tiny Qwen3.5-MoE model equal the
unsharded model's at EP = 2 and 4 (fp32, and float64), padded and packed,
under activation checkpointing, with an MTP head and under tensor
parallelism; in bf16 mixed precision EP matches FSDP2 alone. Each rank
stores and gathers only its experts, reads only those from a Hugging Face
checkpoint, and its checkpoint is the same file at every EP size
(``_ep_worker.py`` runs the configurations, those of a number of
processes in one launch)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

_SCRIPT = Path(__file__).with_name("_ep_worker.py")

NUM_EXPERTS = 8

# fp32 with the model's own and the exchanges' orders of summation.
TOLERANCE = 1e-5


def _run(num_processes: int, cases: dict[str, tuple[Path, int, tuple[str, ...]]]) -> dict[str, list[dict[str, object]]]:
    """Runs ``cases`` (name: output directory, EP size, extra arguments) one
    after another in one launch of ``num_processes`` processes; returns each
    case's results by rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}", str(_SCRIPT)]

    for output_dir, ep, extra_args in cases.values():
        case_args = ["--ep", str(ep), "--output-dir", str(output_dir), *(arg.format(output_dir=output_dir) for arg in extra_args)]

        command += ["--case", shlex.join(case_args)]

    env = dict(os.environ, FAIRSEQ2_DEVICE="cpu", FAIRSEQ2_EXTENSION_TRACE="1", OMP_NUM_THREADS="1")

    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)

    assert process.returncode == 0, process.stderr[-5000:]

    return {
        name: [json.loads((output_dir / f"rank_{rank}.json").read_text()) for rank in range(num_processes)]
        for name, (output_dir, _, _) in cases.items()
    }


_CASES = {
    # (processes, EP size; 0: FSDP2 alone, extra arguments)
    # With the MTP head, whose MoE layer is outside the decoder's units.
    "ep2-of-2": (2, 2, ("--mtp",)),
    "fsdp2-4": (4, 0, ()),
    "ep2-of-4": (4, 2, ("--hf-dir", "{output_dir}/hf")),
    "ep4-of-4": (4, 4, ("--hf-dir", "{output_dir}/hf")),
    "ep4-of-4-packed-ac": (4, 4, ("--packed", "--activation-checkpointing")),
    "ep4-of-4-packed-ac-float64": (4, 4, ("--packed", "--activation-checkpointing", "--float64")),
    # Tensor parallel size 2: EP over the 2 data-parallel ranks of each.
    "tp2-ep2-of-4": (4, 2, ("--tp", "2")),
    # FSDP2 mixed precision, as users train.
    "fsdp2-4-bf16": (4, 0, ("--bf16",)),
    "ep4-of-4-bf16": (4, 4, ("--bf16",)),
}

_FP32_CASES = [name for name in _CASES if not name.endswith("bf16")]

# Under tensor parallelism only the parameters that it does not split (and
# the experts) are compared; the tensor-parallel tests compare the rest.
_NUM_COMPARED_GRADS = {"ep2-of-2": 91, "tp2-ep2-of-4": 30}

# The gradients of a Gated DeltaNet layer's decay (`A_log`, `dt_bias`) sum
# terms of both signs over every position and head: when the experts' GEMMs
# group their rows differently (rows of all EP ranks at once), their fp32
# rounding moves them by up to 6.6e-5 of their largest entry (measured,
# packed at EP 4, with one GEMM per expert, the CPU's `auto`; 2.8e-5 with
# the experts batched; FSDP2 alone: 7e-8). In float64 the same case agrees
# to 1e-12, so the difference is rounding, not a different gradient.
_DECAY_TOLERANCE = 2e-4

_TOLERANCES = {"ep4-of-4-packed-ac-float64": 1e-12}


Runs = Callable[[str], tuple[Path, list[dict[str, object]]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Runs a case of ``_CASES`` when a test first asks for it, with every
    other case of its number of processes that has not run yet: one launch
    for each number of processes (each launch starts its processes, which
    import PyTorch and fairseq2, once)."""
    results: dict[str, tuple[Path, list[dict[str, object]]]] = {}

    def run(name: str) -> tuple[Path, list[dict[str, object]]]:
        if name not in results:
            num_processes = _CASES[name][0]

            cases = {
                other: (tmp_path_factory.mktemp(other), ep, extra_args)
                for other, (other_processes, ep, extra_args) in _CASES.items()
                if other_processes == num_processes and other not in results
            }

            for other, case_results in _run(num_processes, cases).items():
                results[other] = (cases[other][0], case_results)

        return results[name]

    return run


@pytest.mark.parametrize("name", _FP32_CASES)
def test_equals_the_unsharded_model(name: str, runs: Runs) -> None:
    _, results = runs(name)

    tolerance = _TOLERANCES.get(name, TOLERANCE)

    decay_tolerance = tolerance if name.endswith("float64") else _DECAY_TOLERANCE

    for rank, result in enumerate(results):
        assert result["logits"] <= tolerance, f"rank {rank}"
        assert result["loss"] <= tolerance, f"rank {rank}"

        # The load-balancing loss of the rank's share, as one process
        # computes it.
        assert result["aux_loss"] <= 1e-6, f"rank {rank}"

        grads = result["grads"]

        assert isinstance(grads, dict)

        # Every parameter has a gradient: 72 in the tiny model, 91 with its
        # MTP head.
        assert result["num_grads"] == _NUM_COMPARED_GRADS.get(name, 72)

        assert result["num_reference_grads"] == (91 if "--mtp" in _CASES[name][2] else 72)

        for param_name in [n for n in grads if n.endswith(("decay.A_log", "decay.dt_bias"))]:
            assert grads.pop(param_name) <= decay_tolerance, f"rank {rank}: {param_name}"

        worst = max(grads, key=grads.__getitem__)

        assert grads[worst] <= tolerance, f"rank {rank}: {worst} differs by {grads[worst]} of its largest entry"


@pytest.mark.parametrize("name", list(_CASES))
def test_each_rank_stores_and_gathers_only_its_experts(
    name: str, runs: Runs
) -> None:
    num_processes, ep, extra_args = _CASES[name]

    _, results = runs(name)

    tp_size = 2 if "--tp" in extra_args else 1

    dp_size = num_processes // tp_size

    num_tp_experts = NUM_EXPERTS // tp_size

    expected_gathered = num_tp_experts // ep if ep > 0 else num_tp_experts

    num_layers = 5 if "--mtp" in extra_args else 4

    all_experts = set()

    for result in results:
        rows = result["expert_rows"]

        assert isinstance(rows, list) and len(rows) == num_layers * 2

        for row in rows:
            assert row["stored"] == num_tp_experts // dp_size, row
            assert row["gathered"] == expected_gathered, row

        # Two (E, 2I, M) and (E, M, I) tensors of 64 x 32 per layer.
        element_size = 8 if "--float64" in extra_args else 4

        assert result["stored_expert_bytes"] == num_layers * (num_tp_experts // dp_size) * 3 * 64 * 32 * element_size

        rank_experts = result["rank_experts"]

        assert isinstance(rank_experts, list)

        all_experts.update(rank_experts[0])

    assert all_experts == set(range(NUM_EXPERTS))


@pytest.mark.parametrize(("fsdp2", "ep_cases"), [("fsdp2-4", ["ep2-of-4", "ep4-of-4"])])
def test_checkpoint_is_the_same_at_every_ep_size(
    fsdp2: str, ep_cases: list[str], runs: Runs
) -> None:
    # fairseq2 checkpoints each rank's local FSDP2 shards: the same tensors
    # make the same files, which load at any EP size.
    fsdp2_dir, results = runs(fsdp2)

    for rank in range(len(results)):
        expected = torch.load(fsdp2_dir / f"rank_{rank}.pt")

        for name in ep_cases:
            state_dict = torch.load(runs(name)[0] / f"rank_{rank}.pt")

            assert state_dict.keys() == expected.keys()

            for key, value in expected.items():
                assert torch.equal(state_dict[key], value), f"{name}, rank {rank}: {key}"


@pytest.mark.parametrize("name", ["ep2-of-4", "ep4-of-4"])
def test_hugging_face_checkpoint_loads_into_each_ranks_experts(name: str, runs: Runs) -> None:
    # The sharded loader, as the recipes use it: each rank reads the rows of
    # the experts it stores, and every gathered tensor equals the reference.
    _, results = runs(name)

    assert [result["hf_loaded_exactly"] for result in results] == [True] * 4


def test_bf16_mixed_precision_matches_fsdp2_alone(runs: Runs) -> None:
    # Both in bf16: the experts are gathered in the other units' dtype, and
    # EP changes only how their GEMMs group rows and how their gradients are
    # reduced (over 1 replica instead of 4 ranks, in bf16).
    fsdp2_dir, fsdp2_results = runs("fsdp2-4-bf16")
    ep_dir, ep_results = runs("ep4-of-4-bf16")

    for rank in range(4):
        assert fsdp2_results[rank]["expert_param_dtypes"] == ep_results[rank]["expert_param_dtypes"] == ["torch.bfloat16"]

        expected = torch.load(fsdp2_dir / f"rank_{rank}_outputs.pt")
        outputs = torch.load(ep_dir / f"rank_{rank}_outputs.pt")

        # The rank's experts (2 of 8 per layer) and every other gradient.
        assert len(outputs) == 3 + 4 * 2 * 2 + (72 - 4 * 2)

        torch.testing.assert_close(outputs.pop("loss"), expected.pop("loss"), rtol=1e-3, atol=0.0)
        torch.testing.assert_close(outputs.pop("aux_loss"), expected.pop("aux_loss"), rtol=1e-3, atol=0.0)
        torch.testing.assert_close(outputs.pop("logits"), expected.pop("logits"), rtol=0.0, atol=2e-2)

        for key, value in outputs.items():
            # Measured: at most 1.2 % of the largest entry (bf16 has 8 bits).
            difference = float((value - expected[key]).abs().max()) / float(expected[key].abs().max())

            assert difference <= 2e-2, f"rank {rank}: {key} differs by {difference} of its largest entry"


@pytest.mark.parametrize("name", ["ep4-of-4-packed-ac"])
def test_imbalance_is_the_busiest_ranks_rows_over_the_mean(name: str, runs: Runs) -> None:
    # The rows each EP rank computed in each layer are those the reference
    # routes to its experts from the group's shares (packed: every token
    # routed); the imbalance is the worst layer's busiest rank over the mean.
    _, results = runs(name)

    for rank, result in enumerate(results):
        rows = torch.tensor(result["rows_per_ep_rank"])

        assert torch.equal(rows, torch.tensor(result["expected_rows_per_ep_rank"]).to(rows.dtype)), f"rank {rank}"

        expected = (rows.max(dim=1).values / rows.float().mean(dim=1)).max()

        assert result["ep_imbalance"] == pytest.approx(float(expected), rel=1e-6), f"rank {rank}"

        assert result["ep_imbalance"] > 1.0
