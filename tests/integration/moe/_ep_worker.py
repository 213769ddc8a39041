"""One forward and backward pass of a tiny Qwen3.5-MoE model under FSDP2,
with or without expert parallelism, against the unsharded model in the same
process.

Run by ``test_expert_parallel.py`` under ``torchrun`` (gloo), with each
``--case`` the arguments of one configuration: the cases run one after
another in the same processes, which start (and import PyTorch and
fairseq2) once. Every rank builds the same model (the reference), shards a
copy with fairseq2's FSDP2 wrapper and our applier (after
:func:`apply_expert_parallelism` if ``--ep`` is given), and runs its share
of the batch through it; the reference runs every rank's share and sums
their losses over the number of ranks, the loss whose gradient FSDP2's
averaged gradients are. Each rank writes to the case's ``--output-dir``:
``rank_<r>.json`` (the largest differences from the reference: absolute for
the logits and the load-balancing loss, relative to the reference's value
for the loss and to its largest entry for each gradient; the rows and bytes
of its experts) and ``rank_<r>.pt`` (its local state dict, as fairseq2
checkpoints it).
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module

from fairseq2.gang import Gangs, ProcessGroupGang, create_fake_gangs, create_fsdp_gangs, create_parallel_gangs, set_gangs
from fairseq2.models.transformer_lm import TransformerLM, apply_ac_to_transformer_lm
from fairseq2.nn import BatchLayout
from fairseq2.nn.fsdp import fsdp2_local_state_dict, to_fsdp2

from qwen35_fs2.compat.fsdp_unit_precision import fsdp_unit_mixed_precision
from qwen35_fs2.hf.export.save import save_hf_model
from qwen35_fs2.hf.sharded_loading import allocate_shards, load_hf_checkpoint_shards
from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model, get_qwen35_moe_model_hub
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config
from qwen35_fs2.nn import collect_moe_statistics
from qwen35_fs2.nn.decoder_layer import Qwen35DecoderLayer
from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.nn.moe.expert_parallel import expert_parallel_order
from qwen35_fs2.nn.moe.statistics import MoeStatistics
from qwen35_fs2.nn.mtp import find_mtp
from qwen35_fs2.parallel.expert_parallel import apply_expert_parallelism, create_expert_parallel_groups
from qwen35_fs2.parallel.fsdp import apply_fsdp_to_qwen35
from qwen35_fs2.recipes.loss import install_chunked_lm_loss

AUX_LOSS_WEIGHT = 0.5

MTP_LOSS_WEIGHT = 0.1

CPU = torch.device("cpu")

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


def _loss(model: Module, batch: Batch) -> tuple[Tensor, Tensor, MoeStatistics]:
    """Returns the loss, the logits and the routing statistics of ``batch``."""
    seqs, layout, targets, target_mask = batch

    with torch.no_grad():
        logits = model(seqs, layout)

    loss = model(seqs, layout, targets, target_mask=target_mask, reduction="sum")

    mtp = find_mtp(model)

    if mtp is not None:
        mtp_loss = mtp.pop_loss()

        assert mtp_loss is not None

        loss = loss + MTP_LOSS_WEIGHT * mtp_loss.nll_loss

    statistics = collect_moe_statistics(model)

    assert statistics is not None

    return loss + AUX_LOSS_WEIGHT * statistics.load_balancing_loss, logits, statistics


def _plain_name(name: str) -> str:
    """``name`` without the prefixes of the activation-checkpoint wrapper."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


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


def _rows_per_ep_rank(share_loads: list[Tensor], rank: int, ep: int) -> Tensor:
    """Returns the rows that each rank of ``rank``'s expert-parallel group
    computes in each layer, from the reference's expert loads of every rank's
    share (:math:`(L,E)` each; packed shares, whose every token is routed).
    *Shape:* :math:`(L,ep)`."""
    num_experts = share_loads[0].size(1)

    order = expert_parallel_order(num_experts, ep, len(share_loads))

    group = rank // ep

    # (L, E): the rows of every expert from the group's ranks.
    loads = torch.stack(share_loads[group * ep : (group + 1) * ep]).sum(dim=0)

    return torch.stack([loads[:, order[r * num_experts // ep : (r + 1) * num_experts // ep]].sum(dim=1) for r in range(ep)], dim=1)


def _expert_param_dtypes(model: Module) -> list[str]:
    """Returns the dtypes in which the FSDP2 units that hold the routed
    experts gather them: their own units under expert parallelism, their
    decoder layers' otherwise."""
    dtypes = set()

    for module in model.modules():
        experts = getattr(module, "ffn", None) if isinstance(module, Qwen35DecoderLayer) else None

        if isinstance(experts, Qwen35MoeBlock):
            unit = module if experts.expert_parallel is None else experts.experts

            dtypes.add(str(fsdp_unit_mixed_precision(unit).param_dtype))

    return sorted(dtypes)


def _create_models(args: argparse.Namespace, gangs: Gangs) -> tuple[TransformerLM, TransformerLM]:
    """Returns the unsharded reference (perturbed from its initialization,
    so that no weight is special) and the same model for ``gangs``, before
    FSDP2: tensor-parallel if ``--tp`` asks (loaded from the reference's
    checkpoint), expert-parallel if ``--ep`` asks."""
    config = tiny_qwen35_moe_config()

    config.mtp_num_layers = int(args.mtp)

    torch.manual_seed(0)

    with set_gangs(create_fake_gangs(CPU)):
        reference = create_qwen35_moe_model(config).train()

    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.02)

    if gangs.tp.size == 1:
        model = copy.deepcopy(reference)
    else:
        path = args.output_dir / "reference"

        if gangs.root.rank == 0:
            shard_dir = path / "pp_00" / "tp_00"

            shard_dir.mkdir(parents=True)

            torch.save(reference.state_dict(), shard_dir / "sdp_00.pt")

        gangs.root.barrier()

        model = get_qwen35_moe_model_hub().load_custom_model(path, config, gangs=gangs, dtype=torch.float32).train()

    if args.mtp:
        for lm in (reference, model):
            install_chunked_lm_loss(lm, chunk_size=64, mtp_loss="train")

    if args.ep > 0:
        apply_expert_parallelism(model, create_expert_parallel_groups(gangs, args.ep))

    return reference, model


def _case_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="--case")

    parser.add_argument("--ep", type=int, default=0, help="the expert parallel size; 0 for none")
    parser.add_argument("--tp", type=int, default=1, help="the tensor parallel size")
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--mtp", action="store_true", help="with an MTP head (a MoE layer outside the decoder)")
    parser.add_argument("--bf16", action="store_true", help="FSDP2 mixed precision in bf16")
    parser.add_argument("--float64", action="store_true", help="everything in float64")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--hf-dir", type=Path, help="also load the reference, saved here in Hugging Face format, into the shards")

    return parser


def main() -> None:
    parser = argparse.ArgumentParser()

    parser.add_argument("--case", action="append", required=True, help="the arguments of one configuration, in one string")

    case_parser = _case_parser()

    cases = [(case, case_parser.parse_args(shlex.split(case))) for case in parser.parse_args().case]

    torch.set_num_threads(1)

    root_gang = ProcessGroupGang.create_default_process_group(CPU)

    for case, args in cases:
        # Names the case that a traceback after it comes from.
        print(f"rank {root_gang.rank}: case {case}", file=sys.stderr, flush=True)

        torch.set_default_dtype(torch.float64 if args.float64 else torch.float32)

        _run_case(args, root_gang)

    torch.distributed.destroy_process_group()


def _run_case(args: argparse.Namespace, root_gang: ProcessGroupGang) -> None:
    gangs = create_fsdp_gangs(create_parallel_gangs(root_gang, tp_size=args.tp))

    rank, world_size = gangs.dp.rank, gangs.dp.size

    root_rank = gangs.root.rank

    reference, model = _create_models(args, gangs)

    # The experts each rank runs (indices of all experts), before FSDP2
    # hides their rows.
    rank_experts = [
        [m.experts.first_local_expert + e for e in (range(m.experts.num_local_experts) if m.expert_parallel is None else m.expert_parallel.rank_experts)]
        for m in model.modules()
        if isinstance(m, Qwen35MoeBlock)
    ]

    if args.activation_checkpointing:
        apply_ac_to_transformer_lm(model, every_nth_layer=1)

    mixed_precision_dtype = torch.bfloat16 if args.bf16 else None

    sharded = to_fsdp2(model, gangs, lambda m, wrap: apply_fsdp_to_qwen35(m, "layer", wrap), mixed_precision_dtype=mixed_precision_dtype)

    shares = _shares(world_size, reference.decoder_frontend.embed.num_embeddings, args.packed)

    loss, logits, statistics = _loss(sharded, shares[rank])

    aux = statistics.load_balancing_loss.detach()

    torch.autograd.backward(loss)

    # FSDP2 averages the gradients of the ranks' losses.
    share_loads = []

    for idx, share in enumerate(shares):
        share_loss, share_logits, share_statistics = _loss(reference, share)

        torch.autograd.backward(share_loss / world_size)

        share_loads.append(share_statistics.tokens_per_expert)

        if idx == rank:
            expected_loss, expected_logits, expected_aux = share_loss.detach(), share_logits, share_statistics.load_balancing_loss.detach()

    expected_params = dict(reference.named_parameters())

    grad_diffs = {}

    expert_rows = []

    stored_expert_bytes = 0

    outputs: dict[str, Tensor] = {"logits": logits.float(), "loss": loss.detach().float(), "aux_loss": aux.float()}

    block_idx = -1

    for name, param in sharded.named_parameters():
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

            assert torch.equal(param.full_tensor(), expected.detach()[rows]), name

            # By expert, to compare runs that hold other experts.
            for row, expert in enumerate(rows):
                outputs[f"{name}.grad.{expert}"] = full_grad[row]
        elif full_grad.shape != expected_grad.shape:
            # A tensor-parallel shard: its experts are compared, and the
            # tensor-parallel tests compare the rest.
            continue
        else:
            outputs[f"{name}.grad"] = full_grad

        grad_diffs[name] = _max_diff(full_grad, expected_grad) / max(float(expected_grad.abs().max()), 1e-12)

    result = {
        "logits": _max_diff(logits, expected_logits),
        "loss": _max_diff(loss.detach(), expected_loss) / float(expected_loss.abs()),
        "aux_loss": _max_diff(aux, expected_aux),
        "grads": grad_diffs,
        "num_grads": len(grad_diffs),
        "num_reference_grads": sum(1 for p in reference.parameters() if p.grad is not None),
        "rank_experts": rank_experts,
        "expert_rows": expert_rows,
        "stored_expert_bytes": stored_expert_bytes,
        "expert_param_dtypes": _expert_param_dtypes(sharded),
    }

    if args.ep > 0 and args.packed:
        assert statistics.rows_per_ep_rank is not None

        result["rows_per_ep_rank"] = statistics.rows_per_ep_rank.tolist()

        result["expected_rows_per_ep_rank"] = _rows_per_ep_rank(share_loads, rank, args.ep).tolist()

        result["ep_imbalance"] = float(statistics.ep_imbalance)

    if args.hf_dir is not None:
        result["hf_loaded_exactly"] = _load_hf_shards(reference, args.hf_dir, args.ep, gangs)

    args.output_dir.mkdir(parents=True, exist_ok=True)

    (args.output_dir / f"rank_{root_rank}.json").write_text(json.dumps(result))

    torch.save(outputs, args.output_dir / f"rank_{root_rank}_outputs.pt")

    torch.save(fsdp2_local_state_dict(sharded), args.output_dir / f"rank_{root_rank}.pt")


if __name__ == "__main__":
    main()
