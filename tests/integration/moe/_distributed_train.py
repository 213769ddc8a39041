"""Trains a tiny Qwen3.5-MoE model for a few steps, data parallel or not.

Run by ``test_moe_distributed.py``, either under ``torchrun`` (each rank
trains on its share of every batch; ``--wrap fsdp2`` or ``ddp``) or as one
process (``--wrap none``) that accumulates the gradients of the same shares
in turn: both minimise the same loss, so they must compute the same
gradients and end with the same weights. The loss of a share is its summed
next-token loss plus ``AUX_LOSS_COEF`` times its load-balancing loss per
target token, over the number of targets of the whole batch, as our recipes
compute it. AdamW's steps do not change when a parameter's gradients are all
scaled alike, so the losses miss gradients reduced with the wrong scale (they
did, with the two processes' gradients 1% too large), and the weights show
it only through AdamW's epsilon, where gradients are tiny: the gradient norm
of every parameter at every step is written too.

Writes ``{"losses": [...], "grad_norms": {name: [...]}, "expert_shard_sizes":
[...]}`` and the final full state dict to ``--output-dir`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from fairseq2.gang import Gangs, ProcessGroupGang, create_fsdp_gangs, create_parallel_gangs
from fairseq2.models.transformer_lm import apply_ac_to_transformer_lm, apply_fsdp_to_transformer_lm
from fairseq2.nn import BatchLayout
from fairseq2.nn.ddp import to_ddp
from fairseq2.nn.fsdp import to_fsdp2

from qwen35_fs2.nn import collect_moe_statistics
from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config

AUX_LOSS_COEF = 0.01

NUM_SHARES = 2

SEQ_LEN = 12


def _batches(num_steps: int, vocab_size: int) -> list[list[tuple[Tensor, list[int]]]]:
    """Every step's batch, as ``NUM_SHARES`` padded shares of two sequences."""
    generator = torch.Generator().manual_seed(1)

    batches = []

    for _ in range(num_steps):
        shares = []

        for _ in range(NUM_SHARES):
            seq_lens = torch.randint(4, SEQ_LEN + 1, (2,), generator=generator).tolist()

            seqs = torch.zeros((2, SEQ_LEN), dtype=torch.int64)

            for idx, n in enumerate(seq_lens):
                # A learnable pattern, so that the loss falls within a few steps.
                start = int(torch.randint(1, 50, (1,), generator=generator))

                seqs[idx, :n] = torch.arange(start, start + n) % (vocab_size - 1) + 1

            shares.append((seqs, seq_lens))

        batches.append(shares)

    return batches


def _share_loss(model: torch.nn.Module, seqs: Tensor, seq_lens: list[int], num_batch_targets: int) -> tuple[Tensor, Tensor]:
    inputs, targets = seqs[:, :-1], seqs[:, 1:]

    target_lens = [n - 1 for n in seq_lens]

    layout = BatchLayout(inputs.shape, target_lens)

    target_mask = torch.arange(inputs.size(1)) < torch.tensor(target_lens).unsqueeze(1)

    nll = model(inputs, layout, targets, target_mask=target_mask, reduction="sum")

    statistics = collect_moe_statistics(model)

    assert statistics is not None

    num_targets = sum(target_lens)

    loss = (nll + AUX_LOSS_COEF * statistics.load_balancing_loss * num_targets) / num_batch_targets

    return loss, nll.detach()


def _plain_name(name: str) -> str:
    """``name`` without what the DDP and activation checkpointing wrappers
    add to it (a state dict has only DDP's)."""
    return name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")


def main() -> None:
    parser = argparse.ArgumentParser()

    parser.add_argument("--wrap", choices=["fsdp2", "ddp", "none"], required=True)
    parser.add_argument("--num-steps", type=int, default=6)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--output-dir", type=Path, required=True)

    args = parser.parse_args()

    torch.set_num_threads(1)

    config = tiny_qwen35_moe_config()

    torch.manual_seed(0)

    lm = create_qwen35_moe_model(config).train()

    if args.activation_checkpointing:
        apply_ac_to_transformer_lm(lm, every_nth_layer=1)

    model: torch.nn.Module = lm

    rank, world_size = 0, 1

    if args.wrap != "none":
        root_gang = ProcessGroupGang.create_default_process_group(torch.device("cpu"))

        gangs: Gangs = create_parallel_gangs(root_gang)

        rank, world_size = root_gang.rank, root_gang.size

        if world_size != NUM_SHARES:
            raise SystemExit(f"error: run with {NUM_SHARES} processes, not {world_size}.")

        if args.wrap == "fsdp2":
            gangs = create_fsdp_gangs(gangs)

            model = to_fsdp2(lm, gangs, lambda m, wrap: apply_fsdp_to_transformer_lm(lm, "layer", wrap))
        else:
            # Experts without tokens get zero gradients, but the recipes still
            # declare the graph dynamic.
            model = to_ddp(lm, gangs, find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    losses = []

    grad_norms: dict[str, list[float]] = {}

    for shares in _batches(args.num_steps, config.vocab_size):
        num_batch_targets = sum(n - 1 for _, seq_lens in shares for n in seq_lens)

        optimizer.zero_grad()

        nll_sum = torch.zeros(())

        my_shares = shares if world_size == 1 else [shares[rank]]

        for seqs, seq_lens in my_shares:
            loss, nll = _share_loss(model, seqs, seq_lens, num_batch_targets)

            # FSDP and DDP average gradients over ranks; undo it, so that the
            # gradient is the sum over shares in both runs.
            torch.autograd.backward(loss * world_size)

            nll_sum += nll

        if world_size > 1:
            torch.distributed.all_reduce(nll_sum)

        for name, param in model.named_parameters():
            grad = torch.zeros(()) if param.grad is None else param.grad

            # Every rank gathers its shards (a collective).
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()

            grad_norms.setdefault(_plain_name(name), []).append(grad.norm().item())

        optimizer.step()

        losses.append(nll_sum.item() / num_batch_targets)

    state_dict = {
        _plain_name(k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }

    expert_shard_sizes = [
        p.to_local().size(0) if isinstance(p, DTensor) else p.size(0)
        for name, p in model.named_parameters()
        if name.endswith("ffn.experts.gate_inner_proj")
    ]

    if rank == 0:
        args.output_dir.mkdir(parents=True, exist_ok=True)

        torch.save(state_dict, args.output_dir / "state_dict.pt")

        (args.output_dir / "result.json").write_text(
            json.dumps({"losses": losses, "grad_norms": grad_norms, "expert_shard_sizes": expert_shard_sizes})
        )

    if world_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
