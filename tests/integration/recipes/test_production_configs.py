"""The production configurations, run as they are on two CPU processes.

``recipes/qwen35_0.8b_gsm8k.yaml`` (SFT), then
``recipes/qwen35_0.8b_gsm8k_eval.yaml`` on its last checkpoint, and
``recipes/qwen35_0.8b_fineweb_edu.yaml`` (continued pretraining), each under
``torchrun --nproc_per_node=2`` with the configuration file unchanged: FSDP2
with static bf16 mixed precision, layerwise activation checkpointing, the
fused AdamW with its no-decay group, the chunked loss, the held-out
validation examples and the capped validation.

What differs is where the files come from and how long the runs are:

- ``hg://`` resolves offline against a Hugging Face Hub cache laid out by the
  test (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``), which holds what the
  configurations name: ``Qwen/Qwen3.5-0.8B-Base`` is a random checkpoint of
  the real Qwen3.5-0.8B configuration (released layout, vision tower, tied,
  bf16, 248,320 tokens) built by the transformers reference;
  ``openai/gsm8k`` and ``HuggingFaceFW/fineweb-edu`` are synthetic corpora of
  their schemas and file names (``qwen35_fs2.datasets.synthetic``);
- the step counts and the tokens per batch (a CPU step of the real batch
  would take hours): one step, with its metrics, a checkpoint and a
  validation after it (fairseq2 validates at the end of training), of 256
  tokens a rank (sequences of up to 256 tokens: the synthetic GSM8K
  examples have up to about 160, and none may be skipped); the evaluation
  generates at most 16 tokens an answer instead of 512 (the random model
  never stops early);
- the SFT run holds out 8 training examples for its validation instead of
  256: the logits of 256 examples over 248,320 tokens cost this machine more
  than two minutes, the same code for every example;
- the depth: the checkpoint has the real configuration and tensor shapes
  with 4 of the 24 layers (three Gated DeltaNet layers and one full-attention
  layer, the real pattern), which the asset card adopts from its config.json.
  Two ranks of the full 24 layers do not fit in this machine's 24 GiB:
  measured, one rank reached 11.5 GiB resident in its first step (98 s for
  1,024 tokens) and the kernel's OOM killer ended the run. A rank of the
  24-layer model holds half of the fp32 weights, gradients and AdamW state
  (16 bytes a parameter) and gathers whole layers and the 248,320-row
  embedding for the forward and backward passes;
- the precision, on a CPU without bf16 matrix products: PyTorch multiplies
  bf16 matrices with oneDNN only where its CPU capability is AVX512
  (``torch.backends.cpu.get_cpu_capability()``), elsewhere in scalar code
  3 to 70 times slower than fp32 (measured on an AMD EPYC of family 25,
  model 1, AVX2 only: the FineWeb-Edu test took 363 s in bf16 against 86 s
  in fp32, once the LM-head loss's own bf16 products were laid out for such
  CPUs; its step ran for more than 14 minutes before).
  There the three runs train and evaluate in fp32
  (``trainer.mixed_precision.mode=off``, ``model.dtype=float32``) and the
  test says so; bf16 mixed precision, static and autocast, is then
  ``test_mixed_precision.py``'s and ``test_bf16_parity.py``'s, at a size
  such a CPU runs;
- the FineWeb-Edu config asks for fla's kernels (``gdn_backend: fla``), which
  run on CUDA only (on CPU only under Triton's interpreter, and only in
  fp32); the test runs the PyTorch kernels instead.

Each rank's peak resident memory and the step times are written to
``docs/performance.md`` ("Production configurations on CPU").
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest
import torch

from hf_reference import end_hf_reference_subprocess, qwen35_0p8b_spec
from hf_reference.runner import HfReferenceBatch
from offline_hub import add_hub_snapshot, offline_hub_env
from qwen35_fs2.datasets.synthetic import write_synthetic_fineweb, write_synthetic_gsm8k
from recipe_runner import read_metrics, run_recipe
from scratch import scratch_dir

# Two ranks of about 9 GiB each of the machine's 24 GiB: nothing else runs
# beside this module under pytest-xdist.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

# The real Qwen3.5-0.8B text configuration (transformers names), with 4 of
# its 24 layers (see the module docstring).
QWEN35_0P8B: Final = qwen35_0p8b_spec(num_hidden_layers=4, layout="vlm", dtype="bfloat16")

NUM_STEPS: Final = 1

# Of the 256 the SFT config holds out (see the module docstring).
NUM_HELD_OUT: Final = 8

# A rank's tokens in a step, and the longest sequence (see the module
# docstring). At this depth the 248,320-row embedding's gradient, gathers and
# update are most of a step, so a step of 256 tokens cost about what one of
# 1,024 did (docs/performance.md); the validation and the activations shrink.
NUM_TOKENS: Final = 256

CPU_CAPABILITY: Final = torch.backends.cpu.get_cpu_capability()

# Whether PyTorch multiplies bf16 matrices on this CPU with oneDNN rather than
# in scalar code (see the module docstring).
BF16_GEMMS: Final = CPU_CAPABILITY == "AVX512"

# The training configs' precision where the CPU has no bf16 products.
PRECISION_OVERRIDES: Final = () if BF16_GEMMS else ("trainer.mixed_precision.mode=off",)

STEP_OVERRIDES: Final = (
    f"regime.num_steps={NUM_STEPS}",
    "regime.publish_metrics_every_n_steps=1",
    f"regime.checkpoint_every_n_steps={NUM_STEPS}",
    *PRECISION_OVERRIDES,
)


@dataclass
class _PeakMemory:
    """Samples the peak resident memory (``VmHWM``, kept by the kernel) of
    the descendants of a process: the ranks under ``torchrun``."""

    peaks: dict[int, int] = field(default_factory=dict)

    def sample(self, root_pid: int) -> None:
        for pid in _descendants(root_pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue

            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    # In kB.
                    self.peaks[pid] = max(self.peaks.get(pid, 0), int(line.split()[1]) << 10)


def _descendants(root_pid: int) -> set[int]:
    parents = {}

    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue

        parents[int(stat.parent.name)] = int(fields[1])

    found: set[int] = set()

    frontier = {root_pid}

    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found

        found |= frontier

    return found


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A Hub cache with what the production configurations download."""
    with scratch_dir(tmp_path_factory, "production_files") as work_dir:
        cache_dir = work_dir / "hub"

        checkpoint_dir = work_dir / "Qwen3.5-0.8B-Base"

        batch = HfReferenceBatch()

        batch.make_tiny_model(checkpoint_dir, QWEN35_0P8B)

        batch.run()

        # The module's only batch: its subprocess would otherwise keep most
        # of a GiB through the ranks' runs.
        end_hf_reference_subprocess()

        add_hub_snapshot(cache_dir, "Qwen/Qwen3.5-0.8B-Base", checkpoint_dir)

        # GSM8K: more training examples than the 256 the SFT config holds out,
        # and a test split of two batches of the eval config.
        gsm8k_dir = work_dir / "gsm8k"

        write_synthetic_gsm8k(gsm8k_dir, num_train=320, num_test=8, seed=0)

        add_hub_snapshot(cache_dir, "openai/gsm8k", gsm8k_dir, repo_type="dataset")

        # FineWeb-Edu sample-10BT: the 14 shards of the config's file patterns,
        # each of several row groups as the real ones (the readers divide row
        # groups among the ranks).
        fineweb_dir = work_dir / "fineweb-edu"

        write_synthetic_fineweb(fineweb_dir, num_shards=14, docs_per_shard=16, seed=0, rows_per_row_group=4)

        add_hub_snapshot(cache_dir, "HuggingFaceFW/fineweb-edu", fineweb_dir, repo_type="dataset")

        yield cache_dir


@pytest.fixture(scope="module")
def measurements() -> Iterator[dict[str, object]]:
    if BF16_GEMMS:
        precision = "bf16, as configured"
    else:
        precision = f"fp32: PyTorch's CPU capability here is {CPU_CAPABILITY}, its bf16 products scalar code"

        warnings.warn(f"The production configurations run in {precision} (see the module docstring).", stacklevel=1)

    results: dict[str, object] = {"precision": precision}

    yield results

    print("production config measurements:", json.dumps(results, indent=2))


def _run_measured(command: str, output_dir: Path, config: str, overrides: list[str], hub: Path) -> tuple[list[int], float]:
    """Runs the recipe on 2 processes; returns each rank's peak resident
    memory and the wall time."""
    memory = _PeakMemory()

    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            memory.sample(os.getpid())

    sampler = threading.Thread(target=sample, daemon=True)

    start = time.monotonic()

    sampler.start()

    try:
        run_recipe(command, output_dir, config, overrides, nproc=2, env=offline_hub_env(hub))
    finally:
        done.set()

        sampler.join()

    # The two largest processes are the ranks (torchrun's launcher is small).
    ranks = sorted(memory.peaks.values(), reverse=True)[:2]

    return ranks, time.monotonic() - start


def _assert_decay_stayed_fp32(output_dir: Path) -> None:
    """fairseq2 validates with every parameter gathered in bf16; the Gated
    DeltaNet decay parameters must stay fp32 there too (the layers log a
    warning otherwise)."""
    for log_file in (output_dir / "logs").glob("rank_*.log"):
        assert "decay parameters (A_log, dt_bias) arrive in" not in log_file.read_text()


def test_sft_then_eval_configs_run_as_they_are(
    hub: Path, tmp_path_factory: pytest.TempPathFactory, measurements: dict[str, object]
) -> None:
    with scratch_dir(tmp_path_factory, "sft") as sft_dir, scratch_dir(tmp_path_factory, "eval") as eval_dir:
        overrides = [
            *STEP_OVERRIDES,
            f"dataset.max_seq_len={NUM_TOKENS}",
            f"dataset.max_num_tokens={NUM_TOKENS}",
            f"dataset.num_held_out_examples={NUM_HELD_OUT}",
        ]

        peaks, wall_time = _run_measured("instruction_finetune", sft_dir, "qwen35_0.8b_gsm8k.yaml", overrides, hub)

        metrics = read_metrics(sft_dir)

        assert sorted(metrics) == list(range(1, NUM_STEPS + 1))

        # The model as released: an untrained head over 248,320 tokens starts
        # near log(248,320) = 12.4.
        assert all(10.0 < m["NLL Loss"] < 14.0 for m in metrics.values()), metrics

        valid = read_metrics(sft_dir, "valid")

        # The held-out training examples, validated at the end of training.
        assert valid[NUM_STEPS]["Number of Examples"] == NUM_HELD_OUT

        _assert_decay_stayed_fp32(sft_dir)

        # Every example fits the shorter sequences.
        for log_file in (sft_dir / "logs").glob("rank_*.log"):
            assert "exceed `max_seq_len`" not in log_file.read_text()

        checkpoint_dir = sft_dir / "checkpoints" / f"step_{NUM_STEPS}"

        assert checkpoint_dir.is_dir()

        measurements["sft"] = {"peak_rss_mib": [p >> 20 for p in peaks], "wall_s": round(wall_time), "step_s": [round(m["Compute Time"], 1) for m in metrics.values()]}

        eval_overrides = [f"common.assets.prev_checkpoint_dir={sft_dir / 'checkpoints'}", "seq_generator.config.max_gen_len=16"]

        if not BF16_GEMMS:
            eval_overrides.append("model.dtype=float32")

        peaks, wall_time = _run_measured("eval_gsm8k", eval_dir, "qwen35_0.8b_gsm8k_eval.yaml", eval_overrides, hub)

        records = [json.loads(line) for rank in (0, 1) for line in (eval_dir / "gsm8k" / f"rank_{rank}.jsonl").read_text().splitlines()]

        # Every test question answered once, over the two ranks.
        assert len(records) == 8

        measurements["eval"] = {"peak_rss_mib": [p >> 20 for p in peaks], "wall_s": round(wall_time)}


def test_fineweb_edu_config_runs_as_it_is(
    hub: Path, tmp_path_factory: pytest.TempPathFactory, measurements: dict[str, object]
) -> None:
    with scratch_dir(tmp_path_factory, "fineweb") as output_dir:
        overrides = [
            *STEP_OVERRIDES,
            f"dataset.max_seq_len={NUM_TOKENS}",
            f"dataset.max_num_tokens={NUM_TOKENS}",
            # fla's kernels run on CUDA only (see the module docstring).
            "model.config_overrides.gdn_backend=torch",
        ]

        peaks, wall_time = _run_measured("train", output_dir, "qwen35_0.8b_fineweb_edu.yaml", overrides, hub)

        metrics = read_metrics(output_dir)

        assert sorted(metrics) == list(range(1, NUM_STEPS + 1))

        assert all(10.0 < m["NLL Loss"] < 14.0 for m in metrics.values()), metrics

        assert NUM_STEPS in read_metrics(output_dir, "valid")

        _assert_decay_stayed_fp32(output_dir)

        assert (output_dir / "checkpoints" / f"step_{NUM_STEPS}").is_dir()

        measurements["fineweb_edu"] = {"peak_rss_mib": [p >> 20 for p in peaks], "wall_s": round(wall_time), "step_s": [round(m["Compute Time"], 1) for m in metrics.values()]}
