"""Expert parallelism on 2 and 4 CPU processes (gloo): the logits, loss,
load-balancing loss and every gradient of a tiny Qwen3.5-MoE model equal the
unsharded model's at EP = 2 and 4, padded and packed, each rank stores and
gathers only its experts, and its checkpoint is the same file at every EP
size (``_ep_worker.py`` runs each configuration)."""

from __future__ import annotations

import json
import os
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


def _run(output_dir: Path, num_processes: int, ep: int, *extra_args: str) -> list[dict[str, object]]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={num_processes}",
        str(_SCRIPT),
        "--ep",
        str(ep),
        "--output-dir",
        str(output_dir),
        *(arg.format(output_dir=output_dir) for arg in extra_args),
    ]

    env = dict(os.environ, FAIRSEQ2_DEVICE="cpu", FAIRSEQ2_EXTENSION_TRACE="1", OMP_NUM_THREADS="1")

    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)

    assert process.returncode == 0, process.stderr[-5000:]

    return [json.loads((output_dir / f"rank_{rank}.json").read_text()) for rank in range(num_processes)]


_CASES = {
    # (processes, EP size; 0: FSDP2 alone, extra arguments)
    "ep2-of-2": (2, 2, ()),
    "fsdp2-4": (4, 0, ()),
    "ep2-of-4": (4, 2, ("--hf-dir", "{output_dir}/hf")),
    "ep4-of-4": (4, 4, ("--hf-dir", "{output_dir}/hf")),
    "ep4-of-4-packed-ac": (4, 4, ("--packed", "--activation-checkpointing")),
}


Runs = Callable[[str], tuple[Path, list[dict[str, object]]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Runs a case of ``_CASES`` once, when a test first asks for it."""
    results: dict[str, tuple[Path, list[dict[str, object]]]] = {}

    def run(name: str) -> tuple[Path, list[dict[str, object]]]:
        if name not in results:
            num_processes, ep, extra_args = _CASES[name]

            output_dir = tmp_path_factory.mktemp(name)

            results[name] = (output_dir, _run(output_dir, num_processes, ep, *extra_args))

        return results[name]

    return run


@pytest.mark.parametrize("name", list(_CASES))
def test_equals_the_unsharded_model(name: str, runs: Runs) -> None:
    _, results = runs(name)

    for rank, result in enumerate(results):
        assert result["logits"] <= TOLERANCE, f"rank {rank}"
        assert result["loss"] <= TOLERANCE, f"rank {rank}"

        # The load-balancing loss of the rank's share, as one process
        # computes it.
        assert result["aux_loss"] <= 1e-6, f"rank {rank}"

        grads = result["grads"]

        assert isinstance(grads, dict)

        # Every parameter has a gradient: 72 in the tiny model.
        assert result["num_grads"] == result["num_reference_grads"] == 72

        worst = max(grads, key=grads.__getitem__)

        assert grads[worst] <= TOLERANCE, f"rank {rank}: {worst} differs by {grads[worst]} of its largest entry"


@pytest.mark.parametrize("name", list(_CASES))
def test_each_rank_stores_and_gathers_only_its_experts(
    name: str, runs: Runs
) -> None:
    num_processes, ep, _ = _CASES[name]

    _, results = runs(name)

    expected_gathered = NUM_EXPERTS // ep if ep > 0 else NUM_EXPERTS

    all_experts = set()

    for result in results:
        rows = result["expert_rows"]

        assert isinstance(rows, list) and len(rows) == 4 * 2

        for row in rows:
            assert row["stored"] == NUM_EXPERTS // num_processes, row
            assert row["gathered"] == expected_gathered, row

        # Two (E, 2I, M) and (E, M, I) fp32 tensors of 64 x 32 per layer.
        assert result["stored_expert_bytes"] == 4 * (NUM_EXPERTS // num_processes) * 3 * 64 * 32 * 4

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
