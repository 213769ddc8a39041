"""The sizing of Qwen3.5-MoE full fine-tuning with expert parallelism (EP) of
docs/sharding.md ("Expert parallelism: sizing"): memory per GPU and bytes
sent per GPU per step, computed (not measured) from our architecture configs.

The design sized: ``D`` data-parallel GPUs under FSDP2, no tensor
parallelism. EP groups are ``ep`` consecutive ranks; each EP rank computes
``E / ep`` routed experts whole, the tokens reaching them by an all-to-all
(dispatch) and returning by another (combine). Every parameter is stored
sharded over all ``D`` ranks. The experts of an MoE block are an FSDP2 unit
of their own, gathered over the ``R = D / ep`` ranks sharing an EP rank:
``E / ep`` experts. Everything else is gathered whole per decoder layer.
``ep = 1`` is FSDP-only, as today: each decoder layer is one unit, all its
``E`` experts included.

The MTP head of the released checkpoints (``mtp_num_layers=1``, which
loading adopts from their config.json, and which the recipes train) is
counted: its decoder layer as one more layer unit, run after the trunk's,
and not checkpointed (fairseq2 checkpoints ``decoder.layers`` only). Its
``fc`` and norms are counted with the root unit (the embedding, the output
projection and the final norm); the FSDP applier puts them in the head's
own unit, a difference of ``2 M²`` parameters.

Prints markdown tables (as pasted into docs/sharding.md), or with ``--json``
every number. Example::

    PYTHONPATH=src .venv/bin/python scripts/ep_sizing.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from qwen35_fs2.models.qwen35.config import LayerType
from qwen35_fs2.models.qwen35_moe import Qwen35MoeConfig, get_qwen35_moe_model_hub
from qwen35_fs2.recipes.loss import DEFAULT_LOSS_CHUNK_SIZE

ARCHS: Final = ("qwen35_moe_35b_a3b", "qwen35_moe_122b_a10b", "qwen35_moe_397b_a17b")

NUM_GPUS: Final = (8, 16, 64)

EP_SIZES: Final = (1, 2, 4, 8)

TOKENS_PER_GPU: Final = (8192, 16384)

GB: Final = 1e9

GPU_BYTES: Final = 80 * GB

RESERVE_BYTES: Final = 8 * GB
"""Left for the CUDA context, NCCL's buffers, the allocator's fragmentation
and the transients the activation formula leaves out."""

BF16: Final = 2

FP32: Final = 4

STATE_BYTES_PER_PARAM: Final = 16
"""fp32 weights, fp32 gradients and AdamW's two fp32 moments (fused AdamW,
as our recipes set, allocates no temporaries of that size)."""

GDN_CHUNK_SIZE: Final = 64
"""The chunk length of the chunked delta rule (fla's ``chunk_size``)."""

EXCHANGES_CHECKPOINTED: Final = 6
"""All-to-alls per step of a checkpointed MoE layer: dispatch and combine in
the forward pass, again in its recomputation, and their two gradients."""

EXCHANGES: Final = 4
"""All-to-alls per step of an MoE layer that is not checkpointed (the MTP
head's)."""


def sizing_config(arch: str, mtp_layers: int = 1) -> Qwen35MoeConfig:
    """Returns the configuration of ``arch`` with ``mtp_layers`` MTP layers."""
    config = dataclasses.replace(
        get_qwen35_moe_model_hub().get_arch_config(arch), mtp_num_layers=mtp_layers
    )

    if config.experts.dense_layers:
        raise ValueError(
            f"`config.experts.dense_layers` must be empty (every layer an MoE layer), but is {config.experts.dense_layers} instead."
        )

    return config


@dataclass(frozen=True)
class ParameterCounts:
    """The parameters of a Qwen3.5-MoE model, by FSDP unit."""

    root: int
    """The embedding, the output projection, the final norm, and the MTP
    head's ``fc`` and norms."""

    layers: tuple[int, ...]
    """The parameters of each decoder layer without its routed experts,
    trunk layers then MTP layers."""

    experts_per_layer: int
    """The routed experts of one MoE block, all ``E`` of them."""

    num_trunk_layers: int

    @property
    def experts(self) -> int:
        return self.experts_per_layer * len(self.layers)

    @property
    def non_experts(self) -> int:
        return self.root + sum(self.layers)

    @property
    def total(self) -> int:
        return self.experts + self.non_experts

    @property
    def num_mtp_layers(self) -> int:
        return len(self.layers) - self.num_trunk_layers


def count_parameters(config: Qwen35MoeConfig) -> ParameterCounts:
    """Counts the parameters of ``config`` from its widths, as the factory
    builds them."""
    d = config.model_dim

    key_dim = config.num_linear_key_heads * config.linear_key_head_dim
    value_dim = config.num_linear_value_heads * config.linear_value_head_dim

    # The convolution runs over [q | k | v].
    conv_dim = 2 * key_dim + value_dim

    heads = config.num_linear_value_heads

    # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, conv1d, A_log and
    # dt_bias, the gated norm (one gain per value-head dimension), output_proj.
    gdn = conv_dim * d + value_dim * d + 2 * heads * d + conv_dim * config.linear_conv_kernel_size
    gdn += 2 * heads + config.linear_value_head_dim + value_dim * d

    attn_dim = config.num_attn_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim

    # q_proj (queries and their output gates), k_proj, v_proj, q_norm and
    # k_norm, output_proj.
    attn = 2 * attn_dim * d + 2 * kv_dim * d + 2 * config.head_dim + attn_dim * d

    experts = config.experts

    # The two layer norms, the router, the shared expert and its gate.
    rest = 2 * d + experts.num_experts * d + 3 * d * experts.shared_expert_inner_dim + d

    layers = [gdn + rest if kind == "linear_attention" else attn + rest for kind in config.get_layer_types()]

    # The MTP head's layers are full-attention layers.
    layers += [attn + rest] * config.mtp_num_layers

    root = (1 if config.tied_embeddings else 2) * config.vocab_size * d + d

    if config.mtp_num_layers > 0:
        # fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layer_norm.
        root += 2 * d * d + 3 * d

    return ParameterCounts(
        root=root,
        layers=tuple(layers),
        experts_per_layer=3 * experts.num_experts * d * experts.inner_dim,
        num_trunk_layers=config.num_layers,
    )


def check_ep(config: Qwen35MoeConfig, num_gpus: int, ep: int) -> None:
    """Raises a :class:`ValueError` if ``ep`` does not divide ``num_gpus``
    and the number of experts."""
    num_experts = config.experts.num_experts

    if ep < 1 or num_gpus % ep != 0 or num_experts % ep != 0:
        raise ValueError(
            f"`ep` must divide the number of GPUs ({num_gpus}) and of experts ({num_experts}), but is {ep} instead."
        )


def gathered_experts(counts: ParameterCounts, ep: int) -> int:
    """The expert parameters an EP rank gathers for one MoE block: ``E / ep``
    experts."""
    return counts.experts_per_layer // ep


@dataclass(frozen=True)
class Memory:
    """The bytes a GPU holds at the peak of a step."""

    state: float
    """The shards of the fp32 weights, gradients and AdamW moments."""

    root: float
    """The root unit while the layers run backward: its bf16 parameters, and
    the bf16 gradients of all of it but the embedding."""

    layers: float
    """The layer units gathered at once in the backward pass, with the
    gradients of the one being reduced."""

    activations: float
    """What autograd keeps, the loss chunk included
    (:func:`activation_bytes_per_token`)."""

    root_reduce: float
    """The root unit at the end of the backward pass, when no layer is
    gathered: bf16 parameters and gradients and the reduce-scatter buffer."""

    @property
    def peak(self) -> float:
        return self.state + max(self.root + self.layers + self.activations, self.root_reduce)

    @property
    def fits(self) -> bool:
        return self.peak <= GPU_BYTES - RESERVE_BYTES


def layer_buffer_bytes(counts: ParameterCounts, ep: int, reduce_bytes: int = FP32) -> float:
    """The bytes of the layer units gathered at once at the peak of the
    backward pass, FSDP2 prefetching one unit ahead.

    Layer ``i`` is recomputed (activation checkpointing) with all its units
    gathered; its gradients exist in bf16 and, while FSDP2 copies them for
    the reduce-scatter, in ``reduce_bytes``; FSDP2 has prefetched the next
    unit in backward order. With ``n`` the largest layer without its experts
    and ``x`` the experts gathered:

    - ``ep = 1`` (one unit ``u = n + x`` per layer): ``u`` gathered, its
      gradients, the next layer: ``(2 + 2 + r) u + 2 u``;
    - ``ep > 1``: while the experts run backward, the layer (``n + x``) and
      the next layer's non-expert unit, prefetched by the experts' unit,
      with the experts' gradients: ``2 (2 n + x) + (2 + r) x``; then, the
      experts released, the layer's non-expert unit, the next one and its
      gradients: ``2 (2 n) + (2 + r) n``.
    """
    n = max(counts.layers)

    x = gathered_experts(counts, ep)

    grads = BF16 + reduce_bytes

    if ep == 1:
        return (BF16 + grads + BF16) * (n + x)

    return max(BF16 * (2 * n + x) + grads * x, 2 * BF16 * n + grads * n)


def activation_bytes_per_token(config: Qwen35MoeConfig, ep: int) -> float:
    """The activation bytes per token of a step under layerwise activation
    checkpointing (estimated, bf16 unless said otherwise):

    - every trunk layer's checkpointed input, ``2 M``;
    - one layer recomputed at a time, the larger of a Gated DeltaNet and an
      attention layer (:func:`layer_working_set_per_token`);
    - each MTP layer, not checkpointed, in full, plus its ``fc`` input
      (``2 M``) and output, and its norm's output, and the fp32 gradient of
      its loss input: ``2 · 4 M + 4 M``;
    - the final norm's output and the fp32 gradient of the loss input:
      ``2 M + 4 M``.
    """
    d = config.model_dim

    recomputed = max(
        layer_working_set_per_token(config, "linear_attention", ep),
        layer_working_set_per_token(config, "full_attention", ep),
    )

    mtp = layer_working_set_per_token(config, "full_attention", ep) + BF16 * 4 * d + FP32 * d

    return BF16 * d * config.num_layers + recomputed + config.mtp_num_layers * mtp + BF16 * d + FP32 * d


def layer_working_set_per_token(config: Qwen35MoeConfig, kind: LayerType, ep: int) -> float:
    """The bytes per token one decoder layer keeps for its backward pass
    (estimated): with ``C`` the Gated DeltaNet's convolution channels,
    ``V`` its value width (``H_v`` heads of ``d_k x d_v``), ``Q`` and ``KV``
    the attention's query and key/value widths (``H`` heads):

    - a Gated DeltaNet mixer: ``2 (2 M + 2 C + 4 V + 2 H_v)`` (the norm's
      and the output projection's outputs, the projections' and the
      convolution's outputs, the kernel's output, the gated norm, ``a``
      and ``b``) and, in fp32, ``4 H_v (64 + 2 d_k d_v / 64)``: the
      intra-chunk matrices, and the state at every 64-token chunk start with
      its gradient;
    - an attention mixer: ``2 (2 M + 5 Q + 3 KV)`` (queries and gates, keys
      and values, both normed and rotated, the attention's output and its
      gated product) and the fp32 log-sum-exps ``4 H``;
    - the MoE block's norm and shared expert, router logits and fp32
      probabilities: ``2 (2 M + 3 I_s + E) + 4 E``;
    - the routed experts: each of the ``K`` copies of a token, its gate and
      up outputs, their product and the expert's output,
      ``2 K (2 M + 3 I)``, and under EP the all-to-all's send buffer,
      ``2 K M``.
    """
    d = config.model_dim

    if kind == "linear_attention":
        heads = config.num_linear_value_heads

        value_dim = heads * config.linear_value_head_dim

        conv_dim = 2 * config.num_linear_key_heads * config.linear_key_head_dim + value_dim

        state = config.linear_key_head_dim * config.linear_value_head_dim

        mixer = BF16 * (2 * d + 2 * conv_dim + 4 * value_dim + 2 * heads)
        mixer += FP32 * heads * (GDN_CHUNK_SIZE + 2 * state / GDN_CHUNK_SIZE)
    elif kind == "full_attention":
        attn_dim = config.num_attn_heads * config.head_dim
        kv_dim = config.num_key_value_heads * config.head_dim

        mixer = BF16 * (2 * d + 5 * attn_dim + 3 * kv_dim) + FP32 * config.num_attn_heads
    else:
        raise ValueError(
            f"`kind` must be 'linear_attention' or 'full_attention', but is '{kind}' instead."
        )

    experts = config.experts

    block = BF16 * (2 * d + 3 * experts.shared_expert_inner_dim + experts.num_experts)
    block += FP32 * experts.num_experts

    routed = BF16 * experts.top_k * (2 * d + 3 * experts.inner_dim)

    if ep > 1:
        routed += BF16 * experts.top_k * d

    return mixer + block + routed


def loss_chunk_bytes(config: Qwen35MoeConfig, chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE) -> float:
    """The logits of a chunk of the loss, bf16 and fp32."""
    return chunk_size * config.vocab_size * (BF16 + FP32)


def memory_per_gpu(
    config: Qwen35MoeConfig, num_gpus: int, ep: int, tokens: int, reduce_bytes: int = FP32
) -> Memory:
    """The bytes a GPU of ``num_gpus`` holds at the peak of a step of
    ``tokens`` tokens per GPU under ``ep``-way EP."""
    check_ep(config, num_gpus, ep)

    counts = count_parameters(config)

    # The embedding's gradient is made last, after the layers' buffers are
    # released.
    embedding = config.vocab_size * config.model_dim

    return Memory(
        state=STATE_BYTES_PER_PARAM * counts.total / num_gpus,
        root=BF16 * counts.root + BF16 * (counts.root - embedding),
        layers=layer_buffer_bytes(counts, ep, reduce_bytes),
        activations=tokens * activation_bytes_per_token(config, ep) + loss_chunk_bytes(config),
        root_reduce=(BF16 + BF16 + reduce_bytes) * counts.root,
    )


@dataclass(frozen=True)
class Traffic:
    """The bytes a GPU sends in a step."""

    fsdp: float
    """All-gathers of parameters (bf16) and reduce-scatters of gradients."""

    all_to_all: float
    """EP's dispatches and combines, forward and backward."""

    @property
    def total(self) -> float:
        return self.fsdp + self.all_to_all


def _ring_share(size: int) -> float:
    """The share of a collective's buffer each of ``size`` ranks sends."""
    return (size - 1) / size


def _gathers(counts: ParameterCounts, layer_idx: int) -> int:
    """How often the units of a layer are all-gathered in a step: in the
    forward and the backward pass, except the last one to run forward, which
    FSDP2 keeps gathered for the backward pass."""
    return 1 if layer_idx == len(counts.layers) - 1 else 2


def bytes_sent_per_gpu(
    config: Qwen35MoeConfig, num_gpus: int, ep: int, tokens: int, reduce_bytes: int = FP32
) -> Traffic:
    """The bytes a GPU of ``num_gpus`` sends in a step of ``tokens`` tokens
    per GPU under ``ep``-way EP, with uniform routing.

    A ring all-gather or reduce-scatter of a unit of ``S`` bytes over ``n``
    ranks sends ``(n - 1) / n · S`` per rank. The root unit is gathered once
    (not resharded after the forward pass), every layer unit twice but the
    last, and each is reduced once. An all-to-all sends ``(ep - 1) / ep`` of
    the ``T · K`` routed rows of ``M`` bf16 values.
    """
    check_ep(config, num_gpus, ep)

    counts = count_parameters(config)

    x = gathered_experts(counts, ep)

    fsdp = _ring_share(num_gpus) * counts.root * (BF16 + reduce_bytes)

    for idx, layer in enumerate(counts.layers):
        per_param = _gathers(counts, idx) * BF16 + reduce_bytes

        if ep == 1:
            fsdp += _ring_share(num_gpus) * (layer + x) * per_param
        else:
            fsdp += _ring_share(num_gpus) * layer * per_param
            fsdp += _ring_share(num_gpus // ep) * x * per_param

    experts = config.experts

    rows = tokens * experts.top_k * config.model_dim * BF16

    all_to_all = _ring_share(ep) * rows * _exchanges(counts)

    return Traffic(fsdp=fsdp, all_to_all=all_to_all)


def _exchanges(counts: ParameterCounts) -> int:
    """The all-to-alls of a step: checkpointed trunk layers run theirs once
    more."""
    return EXCHANGES_CHECKPOINTED * counts.num_trunk_layers + EXCHANGES * counts.num_mtp_layers


def crossover_tokens(config: Qwen35MoeConfig, reduce_bytes: int = FP32) -> float:
    """The tokens per GPU below which EP (any ``ep > 1``) sends fewer bytes
    than FSDP-only.

    EP leaves the non-expert traffic as it is. Of the experts' traffic it
    saves ``(ep - 1) / ep · 3 E M I · G`` bytes, ``G`` the bytes each expert
    parameter costs per step summed over the MoE layers
    (``Σ (2 · gathers + r)``), and its all-to-alls cost
    ``(ep - 1) / ep · 2 T K M · X``, ``X`` the exchanges per step. The
    ``(ep - 1) / ep`` cancel: ``T* = 3 E I G / (2 K X)``.
    """
    counts = count_parameters(config)

    experts = config.experts

    cost = sum(_gathers(counts, idx) * BF16 + reduce_bytes for idx in range(len(counts.layers)))

    return 3 * experts.num_experts * experts.inner_dim * cost / (BF16 * experts.top_k * _exchanges(counts))


def _billions(count: float) -> str:
    return f"{count / 1e9:.3f} B"


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / GB:.1f}"


def _tokens_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def render_tables(
    archs: Sequence[str] = ARCHS,
    num_gpus: Sequence[int] = NUM_GPUS,
    ep_sizes: Sequence[int] = EP_SIZES,
    tokens: Sequence[int] = TOKENS_PER_GPU,
    *,
    mtp_layers: int = 1,
    reduce_bytes: int = FP32,
) -> str:
    """Returns the markdown tables of docs/sharding.md: the parameters of
    each model, then for each its memory and its bytes sent per GPU."""
    configs = [sizing_config(arch, mtp_layers) for arch in archs]

    counts = [count_parameters(config) for config in configs]

    def layers(config: Qwen35MoeConfig) -> str:
        num_full = config.get_layer_types().count("full_attention")

        return f"{config.num_layers} ({config.num_layers - num_full} / {num_full}) + {config.mtp_num_layers}"

    def widths(config: Qwen35MoeConfig) -> str:
        experts = config.experts

        return f"{config.model_dim}, {experts.num_experts}, {experts.top_k}, {experts.inner_dim}, {experts.shared_expert_inner_dim}"

    params = [
        ["layers (Gated DeltaNet / attention) + MTP", *map(layers, configs)],
        ["`M`, `E`, `K`, `I`, shared expert's `I`", *map(widths, configs)],
        ["parameters", *(_billions(c.total) for c in counts)],
        ["routed experts", *(_billions(c.experts) for c in counts)],
        ["the rest", *(_billions(c.non_experts) for c in counts)],
        ["root unit (embedding, head, final norm, MTP `fc` and norms)", *(_billions(c.root) for c in counts)],
        ["largest layer without its experts", *(_billions(max(c.layers)) for c in counts)],
        ["experts of one MoE layer (all `E`)", *(_billions(c.experts_per_layer) for c in counts)],
        ["EP crossover `T*`, tokens per GPU", *(f"{crossover_tokens(c, reduce_bytes):,.0f}" for c in configs)],
    ]

    lines = _markdown_table(["", *archs], params)

    labels = [_tokens_label(t) for t in tokens]

    budget = _gb(GPU_BYTES - RESERVE_BYTES)

    for arch, config, count in zip(archs, configs, counts):
        memory_rows = []
        traffic_rows = []

        for size in num_gpus:
            for ep in ep_sizes:
                memory = [memory_per_gpu(config, size, ep, t, reduce_bytes) for t in tokens]
                traffic = [bytes_sent_per_gpu(config, size, ep, t, reduce_bytes) for t in tokens]

                row = [str(size), str(ep), _billions(gathered_experts(count, ep))]

                row += [_gb(memory[0].state), _gb(memory[0].root), _gb(memory[0].layers)]

                for m in memory:
                    row += [_gb(m.activations), _gb(m.peak) if m.fits else f"{_gb(m.peak)} (> {budget})"]

                memory_rows.append(row)

                row = [str(size), str(ep), _gb(traffic[0].fsdp)]

                for t in traffic:
                    row += [_gb(t.all_to_all), _gb(t.total)]

                traffic_rows.append(row)

        memory_header = ["GPUs", "ep", "experts gathered", "state", "root", "layers"]
        memory_header += [f"{name} {label}" for label in labels for name in ("activations", "peak")]

        traffic_header = ["GPUs", "ep", "FSDP"]
        traffic_header += [f"{name} {label}" for label in labels for name in ("all-to-all", "total")]

        lines += ["", f"**{arch}**: memory, GB per GPU", ""] + _markdown_table(memory_header, memory_rows)
        lines += ["", f"**{arch}**: bytes sent, GB per GPU per step", ""] + _markdown_table(traffic_header, traffic_rows)

    return "\n".join(lines)


def sizing_report(
    archs: Sequence[str] = ARCHS,
    num_gpus: Sequence[int] = NUM_GPUS,
    ep_sizes: Sequence[int] = EP_SIZES,
    tokens: Sequence[int] = TOKENS_PER_GPU,
    *,
    mtp_layers: int = 1,
    reduce_bytes: int = FP32,
) -> dict[str, Any]:
    """Returns every number of the tables, in parameters and bytes."""
    report: dict[str, Any] = {
        "gpu_bytes": GPU_BYTES,
        "reserve_bytes": RESERVE_BYTES,
        "reduce_bytes": reduce_bytes,
        "mtp_layers": mtp_layers,
    }

    for arch in archs:
        config = sizing_config(arch, mtp_layers)

        counts = count_parameters(config)

        rows = []

        for size in num_gpus:
            for ep in ep_sizes:
                for t in tokens:
                    memory = memory_per_gpu(config, size, ep, t, reduce_bytes)
                    traffic = bytes_sent_per_gpu(config, size, ep, t, reduce_bytes)

                    rows.append({
                        "num_gpus": size,
                        "ep": ep,
                        "tokens": t,
                        "gathered_expert_params": gathered_experts(counts, ep),
                        "memory": dataclasses.asdict(memory) | {"peak": memory.peak, "fits": memory.fits},
                        "bytes_sent": dataclasses.asdict(traffic) | {"total": traffic.total},
                    })

        report[arch] = {
            "params": dataclasses.asdict(counts) | {"experts": counts.experts, "total": counts.total},
            "crossover_tokens": crossover_tokens(config, reduce_bytes),
            "rows": rows,
        }

    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS_PER_GPU), help="tokens per GPU per step")
    parser.add_argument("--gpus", type=int, nargs="+", default=list(NUM_GPUS), help="data-parallel GPUs")
    parser.add_argument("--ep", type=int, nargs="+", default=list(EP_SIZES), help="EP sizes")
    parser.add_argument("--mtp-layers", type=int, default=1, choices=(0, 1), help="MTP layers (1: the released checkpoints)")
    parser.add_argument("--bf16-reduce", action="store_true", help="reduce gradients in bf16 (`trainer.fsdp.fp32_reduce: false`)")
    parser.add_argument("--json", action="store_true", help="print every number as JSON")

    args = parser.parse_args()

    options = {"mtp_layers": args.mtp_layers, "reduce_bytes": BF16 if args.bf16_reduce else FP32}

    if args.json:
        print(json.dumps(sizing_report(ARCHS, args.gpus, args.ep, args.tokens, **options)))
    else:
        print(render_tables(ARCHS, args.gpus, args.ep, args.tokens, **options))


if __name__ == "__main__":
    main()
