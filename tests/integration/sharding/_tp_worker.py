"""Runs tiny Qwen3.5 models under 2-way tensor parallelism and compares them
with the unsharded model; run by ``test_tensor_parallel.py`` under
``torchrun --nproc_per_node=2``.

For each case, a new model under TP=2 must hold the shards of the
unsharded model created from the same seed, bit for bit. Then every rank
builds the same unsharded model (its weights
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

The same models with LoRA adapters on every target (``lora_*`` cases, the
base frozen): adapters put on the TP=2 model from the same seed are the
shards of those of the unsharded model; with random adapters (read from the
unsharded model's adapter checkpoint as the export reads a LoRA run's,
split by the adapters' shard dims), the logits, the loss and every adapter gradient
agree; and the TP=2 adapters, saved as a 2-shard checkpoint, load under
TP=1 as the unsharded ones, bit for bit.

Gradients clipped to half their norm, as the recipes' ``max_grad_norm``
clips them, by the norm of the whole model's gradient over the ranks
(:mod:`qwen35_fs2.parallel.grad_norm`), are the unsharded model's clipped
gradients, in every case.

Differences are relative to the largest magnitude of the expected tensor.
Writes ``{case: {"max_logit_diff": ..., "loss_diff": ..., "max_grad_diff":
..., "grad_norm_diff": ...}}`` (and ``"mtp_loss_diff"`` for the cases with
an MTP head) to ``--output-dir/result.json`` (rank 0).
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
from fairseq2.nn.data_parallel import get_data_parallel_facade

from qwen35_fs2.lora import LoraConfig, apply_lora, lora_parameters
from qwen35_fs2.lora.checkpoint import LoraCheckpointFacade
from qwen35_fs2.lora.sharded import read_lora_checkpoint
from qwen35_fs2.nn.lora import is_lora_key

from qwen35_fs2.nn import collect_moe_statistics
from qwen35_fs2.nn.mtp import find_mtp
from qwen35_fs2.models.qwen35 import create_qwen35_model, get_qwen35_model_hub
from qwen35_fs2.models.qwen35_moe import (
    create_qwen35_moe_model,
    get_qwen35_moe_model_hub,
)
from qwen35_fs2.models.qwen35.config import Qwen35Config, tiny_qwen35_config
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig, tiny_qwen35_moe_config
from qwen35_fs2.parallel.grad_norm import clip_grad_norm_over_ranks, tensor_parallel_shards
from qwen35_fs2.recipes.loss import install_chunked_lm_loss

CPU = torch.device("cpu")

# Two fp32 computations that may round differently (a rank's GEMM over half
# the rows blocks differently). Logits and losses of the two runs agree to
# this; a wrong shard or a missing reduction is off by 1e-2 or more.
TOLERANCE = 2e-5

# The gradients' rounding depends on the CPU: on an AMD EPYC every fp32
# gradient of the plain models was within 8.5e-6 of an fp64 run, on an Intel
# Xeon with AVX-512 those of the LoRA models within 8.2e-5. So each case
# measures how far the unsharded fp32 run is from the fp64 one (at least
# this much), and two fp32 runs may differ by twice that.
FP32_GRADIENT_ERROR_FLOOR = 1e-5

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


def _gather_shards(tensors: dict[str, Tensor], shard_dims: dict[str, int], gangs: Gangs) -> dict[str, Tensor]:
    """Returns ``tensors`` with those that are sharded gathered over the
    tensor-parallel ranks."""
    gathered = {}

    for name, tensor in tensors.items():
        dim = shard_dims.get(name)

        if dim is not None:
            splits = [torch.empty_like(tensor) for _ in range(gangs.tp.size)]

            gangs.tp.all_gather_to_list(splits, tensor.contiguous())

            tensor = torch.cat(splits, dim=dim)

        gathered[name] = tensor

    return gathered


def _full_gradients(model: Module, gangs: Gangs) -> dict[str, Tensor]:
    """Returns the gradient of every trainable parameter, those of sharded
    parameters gathered over the tensor-parallel ranks; frozen parameters
    must have none."""
    gradients = {}

    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert param.grad is None, name

            continue

        assert param.grad is not None, name

        gradients[name] = param.grad

    return _gather_shards(gradients, get_shard_dims(model), gangs)


def _relative_diff(actual: Tensor, expected: Tensor) -> float:
    """Returns the largest difference of ``actual`` from ``expected``
    relative to the largest magnitude of ``expected`` (at least 1)."""
    scale = max(1.0, expected.abs().max().item())

    return (actual - expected).abs().max().item() / scale


def _assert_close(actual: Tensor, expected: Tensor, name: str, tolerance: float = TOLERANCE) -> float:
    """Asserts that ``actual`` is within ``tolerance`` of ``expected``,
    relative to the largest magnitude of ``expected`` (at least 1), and
    returns that relative difference.

    Elementwise relative tolerances fail on entries that are sums of large
    terms of both signs, such as the gradient of an embedding row used many
    times: fp32 rounding is relative to the terms, not to their sum.
    """
    diff = _relative_diff(actual, expected)

    assert diff <= tolerance, f"{name}: the largest difference is {diff:.3g} of the largest magnitude ({max(1.0, expected.abs().max().item()):.3g}), more than {tolerance:.3g}."

    return diff


def _max_diff(expected: dict[str, Tensor], actual: dict[str, Tensor], tolerance: float) -> float:
    assert expected.keys() == actual.keys(), expected.keys() ^ actual.keys()

    return max(_assert_close(actual[name], value, name, tolerance) for name, value in expected.items())


def _reference_and_tp_model(config: Qwen35Config, tp_gangs: Gangs, single_gangs: Gangs, path: Path) -> tuple[TransformerLM, TransformerLM]:
    """Returns the unsharded model of ``config`` with perturbed weights and
    the same model loaded under ``tp_gangs`` from its checkpoint at
    ``path``, both in training mode."""
    torch.manual_seed(0)

    with set_gangs(single_gangs):
        reference = _install_mtp_loss(_create(config).train())

    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.02)

    if tp_gangs.root.rank == 0:
        _save_shard(reference, path, tp_rank=0)

    tp_gangs.root.barrier()

    return reference, _install_mtp_loss(_load(path, config, tp_gangs).train())


def _fp64_copy(reference: TransformerLM, config: Qwen35Config, single_gangs: Gangs) -> TransformerLM:
    """Returns ``reference`` (its LoRA adapters included) rebuilt in fp64, in
    training mode, with the MTP loss installed (a deep copy would keep the
    hooks of the original)."""
    with set_gangs(single_gangs):
        copy = _create(config)

    if any(is_lora_key(key) for key in reference.state_dict()):
        apply_lora(copy, _LORA, config)

    copy.load_state_dict(reference.state_dict())

    return _install_mtp_loss(copy.double().train())


def _compare_runs(reference: TransformerLM, model: TransformerLM, config: Qwen35Config, single_gangs: Gangs) -> tuple[dict[str, float], dict[str, Tensor], float]:
    """Runs the same batches through the unsharded ``reference`` and the
    tensor-parallel ``model``, asserts their logits and losses agree, and
    returns the differences, the reference's gradients and the tolerance of
    the gradients of two fp32 runs (see :data:`FP32_GRADIENT_ERROR_FLOOR`)."""
    batches = _batches(config.vocab_size)

    # The unsharded model in fp64: its gradients measure those of fp32.
    reference64 = _fp64_copy(reference, config, single_gangs)

    _run(reference64, batches)

    expected_logits, expected_loss, expected_mtp_loss = _run(reference, batches)

    gradients64 = {n: p.grad for n, p in reference64.named_parameters() if p.grad is not None}

    expected_gradients = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    assert gradients64.keys() == expected_gradients.keys()

    fp32_error = max([FP32_GRADIENT_ERROR_FLOOR] + [_relative_diff(g.double(), gradients64[n]) for n, g in expected_gradients.items()])

    logits, loss, mtp_loss = _run(model, batches)

    result = {
        "max_logit_diff": max(_assert_close(a, e, "logits") for a, e in zip(logits, expected_logits)),
        "loss_diff": _assert_close(loss, expected_loss, "loss"),
    }

    if mtp_loss is not None and expected_mtp_loss is not None:
        result["mtp_loss_diff"] = _assert_close(mtp_loss, expected_mtp_loss, "MTP loss")

    # Far below what a wrong shard or a missing reduction costs.
    assert fp32_error <= 1e-3, f"The unsharded fp32 gradients are {fp32_error:.3g} from fp64, too far to tell rounding from a wrong shard."

    result["fp32_grad_error"] = fp32_error

    return result, expected_gradients, 2 * fp32_error


def _check_clipping(reference: TransformerLM, model: TransformerLM, tp_gangs: Gangs, grad_tolerance: float) -> float:
    """Clips the gradients of both models to half the unsharded model's
    gradient norm, as the recipes' ``max_grad_norm`` would: the TP=2 model's
    by the norm over its ranks, which must be the unsharded model's, and
    then its clipped gradients the unsharded model's clipped ones (the
    replicated parameters' alike on every rank). Returns the difference of
    the norms relative to the unsharded model's."""
    params = [p for p in reference.parameters() if p.grad is not None]

    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=torch.inf)

    torch.nn.utils.clip_grad_norm_(params, max_norm=norm.item() / 2)

    tp_norm = clip_grad_norm_over_ranks(model, norm.item() / 2, tp_gangs, tensor_parallel_shards(model))

    diff = abs(tp_norm.item() - norm.item()) / norm.item()

    assert diff <= grad_tolerance, f"The gradient norm over the ranks is {tp_norm.item()}, but the unsharded model's is {norm.item()}."

    expected_gradients = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    _max_diff(expected_gradients, _full_gradients(model, tp_gangs), grad_tolerance)

    return diff


def _check_new_model(config: Qwen35Config, tp_gangs: Gangs, single_gangs: Gangs) -> None:
    """Asserts that a new model under TP=2 holds the shards of the unsharded
    model of the same seed: fairseq2 seeds every rank alike, and shards
    drawn on their own would repeat one another (expert e that of e + E/2)."""
    torch.manual_seed(3)

    with set_gangs(single_gangs):
        expected = dict(_create(config).named_parameters())

    torch.manual_seed(3)

    with set_gangs(tp_gangs):
        model = _create(config)

    # Parameters, tied ones once.
    actual = _gather_shards({name: param.detach() for name, param in model.named_parameters()}, get_shard_dims(model), tp_gangs)

    assert actual.keys() == expected.keys()

    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def _check_case(name: str, config: Qwen35Config, tp_gangs: Gangs, single_gangs: Gangs, output_dir: Path) -> dict[str, float]:
    _check_new_model(config, tp_gangs, single_gangs)

    reference, model = _reference_and_tp_model(config, tp_gangs, single_gangs, output_dir / name / "tp1")

    result, expected_gradients, grad_tolerance = _compare_runs(reference, model, config, single_gangs)

    result["max_grad_diff"] = _max_diff(expected_gradients, _full_gradients(model, tp_gangs), grad_tolerance)

    result["grad_norm_diff"] = _check_clipping(reference, model, tp_gangs, grad_tolerance)

    # TP=2 -> TP=1.
    tp2_path = output_dir / name / "tp2"

    _save_shard(model, tp2_path, tp_rank=tp_gangs.tp.rank)

    tp_gangs.root.barrier()

    unsharded = _load(tp2_path, config, single_gangs)

    _assert_equal_state(reference, unsharded)

    return result


# Rank 4 and a scaling of 2; dropout off, so that both runs compute the same.
_LORA = LoraConfig(r=4, alpha=8.0)


def _adapter_state(model: Module) -> dict[str, Tensor]:
    return {key: value for key, value in model.state_dict().items() if is_lora_key(key)}


def _save_adapters(model: Module, path: Path, tp_rank: int) -> None:
    """Saves the adapters of ``model``, as a LoRA run's checkpoints hold
    them without the base, as tensor-parallel shard ``tp_rank`` of a fairseq2
    checkpoint at ``path``."""
    shard_dir = path / "pp_00" / f"tp_{tp_rank:02d}"

    shard_dir.mkdir(parents=True, exist_ok=True)

    torch.save(_adapter_state(model), shard_dir / "sdp_00.pt")


def _load_adapters(model: Module, path: Path, gangs: Gangs) -> None:
    """Loads the adapters saved at ``path`` into ``model`` as the export
    reads a LoRA run's checkpoint."""
    LoraCheckpointFacade(get_data_parallel_facade(model)).load_state_dict(read_lora_checkpoint(path, model, gangs))


def _check_lora_case(name: str, config: Qwen35Config, tp_gangs: Gangs, single_gangs: Gangs, output_dir: Path) -> dict[str, float]:
    rank = tp_gangs.root.rank

    reference, model = _reference_and_tp_model(config, tp_gangs, single_gangs, output_dir / name / "base")

    # New adapters from the same seed: the TP=2 ones are shards of the
    # unsharded ones (A random, B zero).
    torch.manual_seed(5)

    apply_lora(reference, _LORA, config)

    torch.manual_seed(5)

    apply_lora(model, _LORA, config)

    new_adapters = _gather_shards(_adapter_state(model), get_shard_dims(model), tp_gangs)

    expected_new = _adapter_state(reference)

    assert new_adapters.keys() == expected_new.keys()

    for key, value in expected_new.items():
        assert torch.equal(new_adapters[key], value), key

    assert any(value.count_nonzero() > 0 for value in expected_new.values())

    # Random adapters (a zero B would leave A without gradient), read by the
    # TP=2 model from the unsharded model's checkpoint.
    with torch.no_grad():
        for param in lora_parameters(reference):
            param.copy_(torch.randn_like(param) * 0.1)

    lora_path = output_dir / name / "tp1"

    if rank == 0:
        _save_adapters(reference, lora_path, tp_rank=0)

    tp_gangs.root.barrier()

    _load_adapters(model, lora_path, tp_gangs)

    result, expected_gradients, grad_tolerance = _compare_runs(reference, model, config, single_gangs)

    assert expected_gradients.keys() == {n for n, p in reference.named_parameters() if is_lora_key(n)}

    result["max_grad_diff"] = _max_diff(expected_gradients, _full_gradients(model, tp_gangs), grad_tolerance)

    result["grad_norm_diff"] = _check_clipping(reference, model, tp_gangs, grad_tolerance)

    # TP=2 -> TP=1.
    tp2_path = output_dir / name / "tp2"

    _save_adapters(model, tp2_path, tp_rank=tp_gangs.tp.rank)

    tp_gangs.root.barrier()

    with set_gangs(single_gangs):
        unsharded = _create(config)

    apply_lora(unsharded, _LORA, config)

    _load_adapters(unsharded, tp2_path, single_gangs)

    for key, value in _adapter_state(reference).items():
        assert torch.equal(_adapter_state(unsharded)[key], value), key

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

    for name, config in _cases().items():
        results[f"lora_{name}"] = _check_lora_case(f"lora_{name}", config, tp_gangs, single_gangs, args.output_dir)

    if root_gang.rank == 0:
        (args.output_dir / "result.json").write_text(json.dumps(results))

    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
