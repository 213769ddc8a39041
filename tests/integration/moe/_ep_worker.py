"""One forward and backward pass of a tiny Qwen3.5-MoE model under FSDP2,
with or without expert parallelism, against the unsharded model in the same
process.

Run by ``test_expert_parallel.py`` under ``torchrun`` (gloo). Every rank
builds the same model (the reference), shards a copy with fairseq2's FSDP2
wrapper and our applier (after :func:`apply_expert_parallelism` if ``--ep``
is given), and runs its share of the batch through it; the reference runs
every rank's share and sums their losses over the number of ranks, the loss
whose gradient FSDP2's averaged gradients are. Each rank writes to
``--output-dir``: ``rank_<r>.json`` (the largest differences from the
reference: absolute for the logits and the load-balancing loss, relative to
the reference's value for the loss and to its largest entry for each
gradient; the rows and bytes of its experts) and ``rank_<r>.pt`` (its local
state dict, as fairseq2 checkpoints it).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module

from fairseq2.gang import Gangs, ProcessGroupGang, create_fsdp_gangs, create_parallel_gangs, set_gangs
from fairseq2.models.transformer_lm import TransformerLM, apply_ac_to_transformer_lm
from fairseq2.nn import BatchLayout
from fairseq2.nn.fsdp import fsdp2_local_state_dict, to_fsdp2

from qwen35_fs2.hf.export.save import save_hf_model
from qwen35_fs2.hf.sharded_loading import allocate_shards, load_hf_checkpoint_shards
from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config
from qwen35_fs2.nn import collect_moe_statistics
from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.parallel.expert_parallel import apply_expert_parallelism, create_expert_parallel_groups
from qwen35_fs2.parallel.fsdp import apply_fsdp_to_qwen35

AUX_LOSS_WEIGHT = 0.5

Batch = tuple[Tensor, BatchLayout, Tensor, Tensor]


def _shares(num_shares: int, vocab_size: int, packed: bool) -> list[Batch]:
    """One batch per rank: ``(seqs, layout, targets, target_mask)``."""
    generator = torch.Generator().manual_seed(3)

    shares = []

    for _ in range(num_shares):
        seq_lens = torch.randint(3, 14, (3,), generator=generator).tolist()

        if packed:
            tokens = torch.randint(1, vocab_size, (sum(seq_lens) + 1,), generator=generator)

            seqs, targets = tokens[:-1], tokens[1:]

            layout = BatchLayout(seqs.shape, seq_lens, packed=True)

            target_mask = torch.ones_like(targets, dtype=torch.bool)
        else:
            tokens = torch.randint(1, vocab_size, (len(seq_lens), max(seq_lens) + 1), generator=generator)

            seqs, targets = tokens[:, :-1], tokens[:, 1:]

            layout = BatchLayout(seqs.shape, seq_lens)

            target_mask = torch.arange(seqs.size(1)) < torch.tensor(seq_lens).unsqueeze(1)

        shares.append((seqs, layout, targets, target_mask))

    return shares


def _loss(model: Module, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """Returns the loss, the logits and the load-balancing loss of ``batch``."""
    seqs, layout, targets, target_mask = batch

    with torch.no_grad():
        logits = model(seqs, layout)

    nll = model(seqs, layout, targets, target_mask=target_mask, reduction="sum")

    statistics = collect_moe_statistics(model)

    assert statistics is not None

    aux = statistics.load_balancing_loss

    return nll + AUX_LOSS_WEIGHT * aux, logits, aux.detach()


def _plain_name(name: str) -> str:
    """``name`` without the prefixes of the activation-checkpoint wrapper."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _load_hf_shards(reference: TransformerLM, hf_dir: Path, ep: int, gangs: Gangs) -> bool:
    """Saves ``reference`` as a Hugging Face checkpoint at ``hf_dir`` (rank
    0), reads it into the shards of a model built on the meta device as the
    recipes build it, and returns whether every gathered parameter equals the
    reference's (the rank's experts, under expert parallelism)."""
    config = tiny_qwen35_moe_config()

    if gangs.root.rank == 0:
        save_hf_model(reference, hf_dir, config=config)

    gangs.root.barrier()

    with torch.device("meta"), set_gangs(gangs, meta=True):
        model = create_qwen35_moe_model(config)

    if ep > 0:
        apply_expert_parallelism(model, create_expert_parallel_groups(gangs, ep))

    allocate_shards(model, gangs, fsdp_granularity="layer")

    load_hf_checkpoint_shards(model, hf_dir, config, gangs)

    expected_params = dict(reference.named_parameters())

    blocks = {name: m for name, m in model.named_modules() if isinstance(m, Qwen35MoeBlock)}

    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name

        expected = expected_params[name].detach()

        block_name = name.rsplit(".experts.", 1)[0]

        if ".experts." in name and blocks[block_name].expert_parallel is not None:
            ep_rows = blocks[block_name].expert_parallel

            assert ep_rows is not None

            expected = expected[ep_rows.rank_experts]

        if not torch.equal(param.full_tensor(), expected):
            return False

    return True


def main() -> None:
    parser = argparse.ArgumentParser()

    parser.add_argument("--ep", type=int, default=0, help="the expert parallel size; 0 for none")
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--hf-dir", type=Path, help="also load the reference, saved here in Hugging Face format, into the shards")

    args = parser.parse_args()

    torch.set_num_threads(1)

    root_gang = ProcessGroupGang.create_default_process_group(torch.device("cpu"))

    gangs = create_fsdp_gangs(create_parallel_gangs(root_gang))

    rank, world_size = gangs.dp.rank, gangs.dp.size

    torch.manual_seed(0)

    reference = create_qwen35_moe_model(tiny_qwen35_moe_config()).train()

    model: Module = copy.deepcopy(reference)

    if args.ep > 0:
        apply_expert_parallelism(model, create_expert_parallel_groups(gangs, args.ep))

    # The experts each rank runs, before FSDP2 hides their rows.
    rank_experts = [
        list(range(m.experts.num_experts)) if m.expert_parallel is None else m.expert_parallel.rank_experts
        for m in model.modules()
        if isinstance(m, Qwen35MoeBlock)
    ]

    if args.activation_checkpointing:
        assert isinstance(model, TransformerLM)

        apply_ac_to_transformer_lm(model, every_nth_layer=1)

    model = to_fsdp2(model, gangs, lambda m, wrap: apply_fsdp_to_qwen35(m, "layer", wrap))

    shares = _shares(world_size, reference.decoder_frontend.embed.num_embeddings, args.packed)

    loss, logits, aux = _loss(model, shares[rank])

    torch.autograd.backward(loss)

    # FSDP2 averages the gradients of the ranks' losses.
    for idx, share in enumerate(shares):
        share_loss, share_logits, share_aux = _loss(reference, share)

        torch.autograd.backward(share_loss / world_size)

        if idx == rank:
            expected_loss, expected_logits, expected_aux = share_loss.detach(), share_logits, share_aux

    expected_params = dict(reference.named_parameters())

    grad_diffs = {}

    expert_rows = []

    stored_expert_bytes = 0

    block_idx = -1

    for name, param in model.named_parameters():
        name = _plain_name(name)

        grad = param.grad

        assert isinstance(grad, DTensor), name

        full_grad = grad.full_tensor()

        expected = expected_params[name]

        assert expected.grad is not None, name

        expected_grad = expected.grad

        if name.endswith("experts.gate_inner_proj"):
            block_idx += 1

        if ".experts." in name:
            rows = rank_experts[block_idx]

            expected_grad = expected_grad[rows]

            expert_rows.append({"name": name, "stored": param.to_local().size(0), "gathered": param.size(0)})

            stored_expert_bytes += param.to_local().numel() * param.element_size()

            full_param = param.full_tensor()

            assert torch.equal(full_param, expected.detach()[rows]), name

        grad_diffs[name] = _max_diff(full_grad, expected_grad) / max(float(expected_grad.abs().max()), 1e-12)

    result = {
        "logits": _max_diff(logits, expected_logits),
        "loss": _max_diff(loss.detach(), expected_loss) / float(expected_loss.abs()),
        "aux_loss": _max_diff(aux, expected_aux),
        "aux_loss_value": float(aux),
        "grads": grad_diffs,
        "num_grads": len(grad_diffs),
        "num_reference_grads": sum(1 for p in reference.parameters() if p.grad is not None),
        "rank_experts": rank_experts,
        "expert_rows": expert_rows,
        "stored_expert_bytes": stored_expert_bytes,
    }

    args.output_dir.mkdir(parents=True, exist_ok=True)

    if args.hf_dir is not None:
        result["hf_loaded_exactly"] = _load_hf_shards(reference, args.hf_dir, args.ep, gangs)

    (args.output_dir / f"rank_{rank}.json").write_text(json.dumps(result))

    torch.save(fsdp2_local_state_dict(model), args.output_dir / f"rank_{rank}.pt")

    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
