"""Runs tiny Qwen3.5 models under 2-way tensor parallelism and compares them
with the unsharded model; run by ``test_tensor_parallel.py`` under
``torchrun --nproc_per_node=2``.

For each case, every rank builds the same unsharded model (its weights
perturbed, so that no norm is trivially 1), saves it as a fairseq2
checkpoint, and loads it under TP=2 through the family's checkpoint loader,
which reshards it by the modules' shard dims. Both models run the same
padded and packed batches; the logits, the loss and the gradients of every
parameter (sharded ones gathered) must agree. The ``dense`` and ``moe``
models carry an MTP head, trained beside the next-token loss through the
recipes' chunked loss (tied and untied output projections, dense and MoE
head layers); the head is replicated on every rank except its decoder
layer, which shards itself as the trunk's do. The TP=2 model is then saved
as a 2-shard fairseq2 checkpoint and loaded under TP=1: it must be the
unsharded model, bit for bit.

Differences are relative to the largest magnitude of the expected tensor.
Writes ``{case: {"max_logit_diff": ..., "loss_diff": ..., "max_grad_diff":
...}}`` (and ``"mtp_loss_diff"`` for the cases with an MTP head) to
``--output-dir/result.json`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor
from torch.nn import Module

from fairseq2.gang import Gangs, ProcessGroupGang, create_fake_gangs, create_parallel_gangs, set_gangs
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout, get_shard_dims

from qwen35_fs2.nn import collect_moe_statistics
from qwen35_fs2.nn.mtp import find_mtp
from qwen35_fs2.models.qwen35 import create_qwen35_model, get_qwen35_model_hub
from qwen35_fs2.models.qwen35_moe import (
    create_qwen35_moe_model,
    get_qwen35_moe_model_hub,
)
from qwen35_fs2.models.qwen35.config import Qwen35Config, tiny_qwen35_config
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig, tiny_qwen35_moe_config
from qwen35_fs2.recipes.loss import install_chunked_lm_loss

CPU = torch.device("cpu")

# Two fp32 computations that may round differently (a rank's GEMM over half
# the rows blocks differently). Each of the single-process fp32 gradients of
# these models is within 8.5e-6 of an fp64 run (largest: a Gated DeltaNet
# convolution kernel), so two fp32 runs may differ by up to twice that; a
# wrong shard or a missing reduction is off by 1e-2 or more.
TOLERANCE = 2e-5

# The weight of the MTP head's loss, as `mtp_loss_weight` weighs it.
MTP_LOSS_WEIGHT = 0.5

# Fewer tokens than a batch's: the loss runs chunk by chunk under TP=2 (a
# sharded output projection) and by blocks of classes under TP=1.
LOSS_CHUNK_SIZE = 8


def _cases() -> dict[str, Qwen35Config]:
    # Tied embeddings; 2 key/value heads, one per rank; an MTP head.
    dense = tiny_qwen35_config()

    dense.mtp_num_layers = 1

    # Untied; one key/value head, replicated on both ranks.
    replicated = tiny_qwen35_config()

    replicated.tied_embeddings = False
    replicated.num_key_value_heads = 1

    # Untied; an MTP head with an MoE layer.
    moe = tiny_qwen35_moe_config()

    moe.mtp_num_layers = 1

    return {"dense": dense, "dense_replicated_kv": replicated, "moe": moe}


def _create(config: Qwen35Config) -> TransformerLM:
    if isinstance(config, Qwen35MoeConfig):
        return create_qwen35_moe_model(config)

    return create_qwen35_model(config)


def _load(path: Path, config: Qwen35Config, gangs: Gangs) -> TransformerLM:
    if isinstance(config, Qwen35MoeConfig):
        return get_qwen35_moe_model_hub().load_custom_model(path, config, gangs=gangs, dtype=torch.float32)

    return get_qwen35_model_hub().load_custom_model(path, config, gangs=gangs, dtype=torch.float32)


def _install_mtp_loss(model: TransformerLM) -> TransformerLM:
    """Makes a model with an MTP head compute the head's loss in its forward
    pass, as the recipes do; returns ``model``."""
    if find_mtp(model) is not None:
        install_chunked_lm_loss(model, chunk_size=LOSS_CHUNK_SIZE, mtp_loss="train")

    return model


def _save_shard(model: Module, path: Path, tp_rank: int) -> None:
    """Saves ``model`` as tensor-parallel shard ``tp_rank`` of a fairseq2
    checkpoint at ``path``."""
    shard_dir = path / "pp_00" / f"tp_{tp_rank:02d}"

    shard_dir.mkdir(parents=True, exist_ok=True)

    torch.save(model.state_dict(), shard_dir / "sdp_00.pt")


def _batches(vocab_size: int) -> list[tuple[Tensor, BatchLayout, Tensor, Tensor]]:
    """A padded and a packed batch: ``(seqs, layout, targets, target_mask)``."""
    generator = torch.Generator().manual_seed(2)

    tokens = torch.randint(1, vocab_size, (2, 13), generator=generator)

    seqs, targets = tokens[:, :-1], tokens[:, 1:]

    seq_lens = [12, 8]

    padded_mask = torch.arange(12) < torch.tensor(seq_lens).unsqueeze(1)

    padded = (seqs, BatchLayout(seqs.shape, seq_lens), targets, padded_mask)

    packed_lens = [5, 9, 6]

    packed_tokens = torch.randint(1, vocab_size, (sum(packed_lens) + 1,), generator=generator)

    packed_seqs, packed_targets = packed_tokens[:-1], packed_tokens[1:]

    packed = (
        packed_seqs,
        BatchLayout(packed_seqs.shape, packed_lens, packed=True),
        packed_targets,
        torch.ones_like(packed_targets, dtype=torch.bool),
    )

    return [padded, packed]


def _run(model: TransformerLM, batches: list[tuple[Tensor, BatchLayout, Tensor, Tensor]]) -> tuple[list[Tensor], Tensor, Tensor | None]:
    """Returns the logits of every batch, the summed loss and the summed
    loss of the MTP head (``None`` without one), after the backward pass of
    the loss."""
    model.zero_grad()

    logits = []

    total = torch.zeros(())

    mtp = find_mtp(model)

    mtp_total = None if mtp is None else torch.zeros(())

    for seqs, layout, targets, target_mask in batches:
        with torch.no_grad():
            logits.append(model(seqs, layout))

        loss = model(seqs, layout, targets, target_mask=target_mask, reduction="sum")

        if mtp is not None:
            mtp_loss = mtp.pop_loss()

            assert mtp_loss is not None and mtp_total is not None

            loss = loss + MTP_LOSS_WEIGHT * mtp_loss.nll_loss

            mtp_total = mtp_total + mtp_loss.nll_loss.detach()

        statistics = collect_moe_statistics(model)

        if statistics is not None:
            loss = loss + 0.5 * statistics.load_balancing_loss

        torch.autograd.backward(loss)

        total = total + loss.detach()

    return logits, total, mtp_total


def _full_gradients(model: Module, gangs: Gangs) -> dict[str, Tensor]:
    """Returns the gradient of every parameter, those of sharded parameters
    gathered over the tensor-parallel ranks."""
    shard_dims = get_shard_dims(model)

    gradients = {}

    for name, param in model.named_parameters():
        grad = param.grad

        assert grad is not None, name

        dim = shard_dims.get(name)

        if dim is not None:
            splits = [torch.empty_like(grad) for _ in range(gangs.tp.size)]

            gangs.tp.all_gather_to_list(splits, grad.contiguous())

            grad = torch.cat(splits, dim=dim)

        gradients[name] = grad

    return gradients


def _assert_close(actual: Tensor, expected: Tensor, name: str) -> float:
    """Asserts that ``actual`` is within ``TOLERANCE`` of ``expected``,
    relative to the largest magnitude of ``expected`` (at least 1), and
    returns that relative difference.

    Elementwise relative tolerances fail on entries that are sums of large
    terms of both signs, such as the gradient of an embedding row used many
    times: fp32 rounding is relative to the terms, not to their sum.
    """
    scale = max(1.0, expected.abs().max().item())

    diff = (actual - expected).abs().max().item() / scale

    assert diff <= TOLERANCE, f"{name}: the largest difference is {diff:.3g} of the largest magnitude ({scale:.3g})."

    return diff


def _max_diff(expected: dict[str, Tensor], actual: dict[str, Tensor]) -> float:
    assert expected.keys() == actual.keys(), expected.keys() ^ actual.keys()

    return max(_assert_close(actual[name], value, name) for name, value in expected.items())


def _check_case(name: str, config: Qwen35Config, tp_gangs: Gangs, single_gangs: Gangs, output_dir: Path) -> dict[str, float]:
    rank = tp_gangs.root.rank

    torch.manual_seed(0)

    with set_gangs(single_gangs):
        reference = _install_mtp_loss(_create(config).train())

    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.02)

    tp1_path = output_dir / name / "tp1"

    if rank == 0:
        _save_shard(reference, tp1_path, tp_rank=0)

    tp_gangs.root.barrier()

    model = _install_mtp_loss(_load(tp1_path, config, tp_gangs).train())

    batches = _batches(config.vocab_size)

    expected_logits, expected_loss, expected_mtp_loss = _run(reference, batches)

    logits, loss, mtp_loss = _run(model, batches)

    result = {
        "max_logit_diff": max(_assert_close(a, e, "logits") for a, e in zip(logits, expected_logits)),
        "loss_diff": _assert_close(loss, expected_loss, "loss"),
    }

    if mtp_loss is not None and expected_mtp_loss is not None:
        result["mtp_loss_diff"] = _assert_close(mtp_loss, expected_mtp_loss, "MTP loss")

    expected_gradients = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    result["max_grad_diff"] = _max_diff(expected_gradients, _full_gradients(model, tp_gangs))

    # TP=2 -> TP=1.
    tp2_path = output_dir / name / "tp2"

    _save_shard(model, tp2_path, tp_rank=tp_gangs.tp.rank)

    tp_gangs.root.barrier()

    unsharded = _load(tp2_path, config, single_gangs)

    _assert_equal_state(reference, unsharded)

    return result


def _assert_equal_state(expected: Module, actual: Module) -> None:
    expected_state = expected.state_dict()
    actual_state = actual.state_dict()

    assert expected_state.keys() == actual_state.keys()

    for key, value in expected_state.items():
        assert torch.equal(actual_state[key], value), key


def main() -> None:
    parser = argparse.ArgumentParser()

    parser.add_argument("--output-dir", type=Path, required=True)

    args = parser.parse_args()

    torch.set_num_threads(1)

    root_gang = ProcessGroupGang.create_default_process_group(CPU)

    tp_gangs = create_parallel_gangs(root_gang, tp_size=2)

    single_gangs = create_fake_gangs(CPU)

    results = {name: _check_case(name, config, tp_gangs, single_gangs, args.output_dir) for name, config in _cases().items()}

    if root_gang.rank == 0:
        (args.output_dir / "result.json").write_text(json.dumps(results))

    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
