"""Measures the peak resident memory of loading a Hugging Face checkpoint
into the FSDP2 shards of 2 ranks; run by ``test_sharded_loading_memory.py``
under ``torchrun --nproc_per_node=2``.

After the process group is up and a tiny model was sharded once (the first
use of FSDP2 and DTensor costs some 35 MB of one-time set-up, whatever the
model), each rank resets its peak resident set size
(``/proc/self/clear_refs``), creates the sharded model, loads its shards,
and reads its peak (``VmHWM``). The difference is what loading took. Each
rank also checks its shards against the checkpoint, after the measurement.

Writes ``{"peak_bytes": [...], "model_bytes": ...}`` to
``--output-dir/result.json`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open
from sharding_testing import CPU
from torch import Tensor
from torch.distributed.tensor import DTensor

from fairseq2.gang import ProcessGroupGang, create_fsdp_gangs, create_parallel_gangs

from qwen35_fs2.models.qwen35.config import Qwen35Config, tiny_qwen35_config
from qwen35_fs2.models.qwen35.interop import convert_qwen35_state_dict
from qwen35_fs2.hf.sharded_loading import (
    create_sharded_qwen35_model,
    load_hf_checkpoint_shards,
)


def memory_test_config() -> Qwen35Config:
    """A dense model of 58M parameters (232 MB in fp32), no tensor more
    than a third of it."""
    return Qwen35Config(
        model_dim=512,
        max_seq_len=2048,
        vocab_size=32_768,
        pad_idx=0,
        tied_embeddings=True,
        num_layers=12,
        num_attn_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_linear_key_heads=4,
        num_linear_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        ffn_inner_dim=1536,
    )


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

    raise RuntimeError(f"/proc/self/status must have a {field} field, but has none.")


def main() -> None:
    parser = argparse.ArgumentParser()

    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--read-buffer-bytes", type=int, required=True)

    args = parser.parse_args()

    torch.set_num_threads(1)

    root_gang = ProcessGroupGang.create_default_process_group(CPU)

    gangs = create_fsdp_gangs(create_parallel_gangs(root_gang))

    config = memory_test_config()

    create_sharded_qwen35_model(tiny_qwen35_config(), gangs)

    gangs.root.barrier()

    # "5" resets the peak resident set size to the current one.
    Path("/proc/self/clear_refs").write_text("5")

    baseline = _status_bytes("VmRSS")

    model = create_sharded_qwen35_model(config, gangs)

    load_hf_checkpoint_shards(model, args.checkpoint, config, gangs, read_buffer_bytes=args.read_buffer_bytes)

    peak = _status_bytes("VmHWM") - baseline

    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    peaks = [torch.zeros((), dtype=torch.int64) for _ in range(gangs.root.size)]

    gangs.root.all_gather_to_list(peaks, torch.tensor(peak))

    # The shards against the checkpoint, converted whole.
    hg = {}

    for file in sorted(args.checkpoint.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            hg.update({key: f.get_tensor(key) for key in f.keys()})

    expected = convert_qwen35_state_dict(hg, config)

    for name, param in model.named_parameters():
        value = expected[name]

        assert isinstance(param, DTensor) and isinstance(value, Tensor), name

        assert torch.equal(param.full_tensor(), value.float()), name

    if root_gang.rank == 0:
        result = {"peak_bytes": [int(p) for p in peaks], "model_bytes": model_bytes}

        (args.output_dir / "result.json").write_text(json.dumps(result))

    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
