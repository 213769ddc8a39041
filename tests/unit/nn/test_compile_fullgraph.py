"""The layers of Qwen3.5 compile with ``torch.compile(fullgraph=True)``, that
is without a single graph break, and train as in eager mode: the Gated
DeltaNet layer, gated attention, the MoE block, a pair of decoder layers
(one of each mixer, each with an MoE block), and a whole tiny MoE model with
its losses (on regular and packed batches). The ``torch`` kernels here; the ``fla`` ones in
``test_gated_deltanet_fla.py``.

The backend is ``aot_eager``: dynamo and AOTAutograd, everything inductor
traces (a graph break or an op that AOTAutograd cannot trace fails here),
without inductor's C++ code generation, which took 26 to 69 s for each
layer's forward and backward passes on the 2-core development machine
(against 6 to 7 s) and up to ten times that on its slow hours. The number
of graphs a packed Gated DeltaNet layer compiles is dynamo's (its guards
decide what recompiles), so that test runs ``aot_eager`` too; inductor
compiles the whole model, and stops recompiling, in
``tests/integration/recipes/test_compile.py``.

Each compiled module is a copy of the eager one, run on the same batch and
the same cotangent; its output and every gradient must match eager's to
fp32 rounding.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.nn import Module

from fairseq2.models.transformer import AttentionBiasCache
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.models.utils.ac import apply_layerwise_ac
from fairseq2.nn import BatchLayout

from qwen35_fs2.compat.attention_mask import make_attention_bias_cache
from qwen35_fs2.compat.dynamo_graphs import compiled_graph_count
from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config
from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config
from qwen35_fs2.nn import collect_moe_statistics
from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.nn.moe.statistics import MoeStatisticsRecorder
from qwen35_fs2.ops.varlen import VarlenMetadata

pytestmark = pytest.mark.slow

_MODEL_DIM = 64

# Not a multiple of the delta rule's chunk size (64).
_SEQ_LEN = 70

_BATCH_SHAPE = (2, _SEQ_LEN)

_PACKED_SHAPE = (2 * _SEQ_LEN,)

# Measured: compiled and eager fp32 differ by up to 3e-6 of a tensor's
# largest entry (the decay parameters, whose gradients sum over all tokens;
# below 1e-6 elsewhere); a lost gradient path or a wrong document boundary
# is off by order one.
_TOL = 1e-5

_Step = Callable[[Module, Tensor, MoeStatisticsRecorder], Tensor]


def _make_model() -> TransformerLM:
    torch.manual_seed(0)

    config = tiny_qwen35_moe_config()

    config.gdn_backend = "torch"

    model = create_qwen35_moe_model(config)

    # Non-trivial norm weights, so that mistakes in their gradients show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))

    return model.train()


def _layout(kind: str) -> BatchLayout:
    if kind == "regular":
        return BatchLayout(_BATCH_SHAPE, None)

    if kind == "padded":
        return BatchLayout(_BATCH_SHAPE, [_SEQ_LEN, 41])

    # Three documents and a padded tail.
    return BatchLayout(_PACKED_SHAPE, [5, 64, 60], packed=True)


def _run(step: _Step, module: Module, layout: BatchLayout) -> dict[str, Tensor]:
    """A forward and backward pass; returns the output, the gradient of the
    input and those of all parameters."""
    generator = torch.Generator().manual_seed(1)

    shape = (*(_PACKED_SHAPE if layout.packed else _BATCH_SHAPE), _MODEL_DIM)

    x = torch.randn(shape, generator=generator).requires_grad_()

    # Pads carry no loss, as in training.
    cotangent = torch.randn(shape, generator=generator) * (layout.position_indices >= 0).unsqueeze(-1)

    recorder = MoeStatisticsRecorder()

    y = step(module, x, recorder)

    loss = (y * cotangent).sum()

    blocks = [m for m in module.modules() if isinstance(m, Qwen35MoeBlock)]

    results = {"y": y.detach()}

    if blocks:
        statistics = recorder.collect(blocks)

        loss = loss + statistics.load_balancing_loss

        results["tokens_per_expert"] = statistics.tokens_per_expert

    loss.backward()

    assert x.grad is not None

    results["dx"] = x.grad

    for name, param in module.named_parameters():
        assert param.grad is not None, f"{name} has no gradient"

        results[f"d{name}"] = param.grad

    return results


def _assert_compiles_like_eager(module: Module, step: _Step, layout: BatchLayout) -> None:
    torch._dynamo.reset()

    compiled_module = copy.deepcopy(module)

    expected = _run(step, module, layout)

    # Raises at the first graph break.
    compiled_step = torch.compile(step, backend="aot_eager", fullgraph=True)

    actual = _run(compiled_step, compiled_module, layout)

    _assert_close(expected, actual, _TOL)


def _assert_close(expected: dict[str, Tensor], actual: dict[str, Tensor], tol: float) -> None:
    assert actual.keys() == expected.keys()

    for name, value in expected.items():
        error = ((actual[name] - value).abs().max() / value.abs().max().clamp(min=1e-12)).item()

        assert error <= tol, f"{name}: relative error {error:.3g} > {tol}"


@pytest.mark.parametrize("kind", ["regular", "padded", "packed"])
def test_gated_deltanet_layer_compiles_like_eager(kind: str) -> None:
    layer = _make_model().decoder.layers[0].linear_attn

    assert layer is not None

    layout = _layout(kind)

    def step(module: Module, x: Tensor, _: MoeStatisticsRecorder) -> Tensor:
        y: Tensor = module(x, layout)

        return y

    _assert_compiles_like_eager(layer, step, layout)


def _bias_cache(module: Module, layout: BatchLayout) -> AttentionBiasCache:
    """The bias cache the decoder makes for ``module``'s layers, before the
    compiled part (with the mask of a packed or padded batch)."""
    return make_attention_bias_cache(module, torch.zeros(()), layout, incremental=False)


@pytest.mark.parametrize("kind", ["regular", "padded", "packed"])
def test_gated_attention_layer_compiles_like_eager(kind: str) -> None:
    attention = _make_model().decoder.layers[3].self_attn

    assert attention is not None

    layout = _layout(kind)

    bias_cache = _bias_cache(attention, layout)

    def step(module: Module, x: Tensor, _: MoeStatisticsRecorder) -> Tensor:
        y: Tensor = module(x, layout, x, layout, x, bias_cache)

        return y

    _assert_compiles_like_eager(attention, step, layout)


@pytest.mark.parametrize("kind", ["regular", "padded"])
def test_moe_block_compiles_like_eager(kind: str) -> None:
    block = _make_model().decoder.layers[0].ffn

    layout = _layout(kind)

    def step(module: Module, x: Tensor, recorder: MoeStatisticsRecorder) -> Tensor:
        y: Tensor = module(x, layout, statistics=recorder)

        return y

    _assert_compiles_like_eager(block, step, layout)


@pytest.mark.parametrize("kind", ["regular", "packed"])
def test_decoder_layers_compile_like_eager(kind: str) -> None:
    layers = _make_model().decoder.layers

    assert layers[0].linear_attn is not None and layers[3].self_attn is not None

    pair = torch.nn.ModuleList([layers[0], layers[3]])

    layout = _layout(kind)

    bias_cache = _bias_cache(pair, layout)

    def step(module: Module, x: Tensor, recorder: MoeStatisticsRecorder) -> Tensor:
        for layer in module.children():
            x, routing = layer(x, layout, bias_cache, return_moe_statistics=True)

            recorder.record(layer.ffn, routing)

        return x

    _assert_compiles_like_eager(pair, step, layout)


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_checkpointed_decoder_layers_compile_on_a_packed_batch(model: str) -> None:
    # fairseq2's layerwise activation checkpointing wraps each layer before
    # it is compiled; a graph break inside the checkpoint would run the
    # whole layer eagerly (and `fullgraph=True` raises). A Gated DeltaNet
    # and an attention layer, with dense FFNs or MoE blocks, whose routing
    # statistics the layers return and the step records outside them, as
    # the decoder does.
    if model == "dense":
        torch.manual_seed(0)

        config = tiny_qwen35_config()

        config.gdn_backend = "torch"

        layers = create_qwen35_model(config).train().decoder.layers
    else:
        layers = _make_model().decoder.layers

    assert layers[0].linear_attn is not None and layers[3].self_attn is not None

    checkpointed = torch.nn.ModuleList([layers[0], layers[3]])

    apply_layerwise_ac(checkpointed, every_nth_layer=1)

    assert all(isinstance(layer, CheckpointWrapper) for layer in checkpointed)

    layout = _layout("packed")

    bias_cache = _bias_cache(checkpointed, layout)

    def step(module: Module, x: Tensor, recorder: MoeStatisticsRecorder) -> Tensor:
        for layer in module.children():
            x, routing = layer(x, layout, bias_cache, return_moe_statistics=True)

            assert (routing is None) == (model == "dense")

            if routing is not None:
                # The wrapped layer's block (dynamo does not follow the
                # wrapper's attribute forwarding).
                recorder.record(layer._checkpoint_wrapped_module.ffn, routing)

        return x

    _assert_compiles_like_eager(checkpointed, step, layout)


# (Padded batches take the same mask as the MTP head's, compiled in
# tests/unit/recipes/test_loss.py.)
@pytest.mark.parametrize("kind", ["regular", "packed"])
def test_whole_model_with_its_loss_compiles_like_eager(kind: str) -> None:
    # The embeddings, the four layers (three Gated DeltaNet and one attention
    # layer, all with MoE blocks), the LM head and its loss as one graph; the
    # attention mask of a packed batch too.
    model = _make_model()

    compiled_model = copy.deepcopy(model)

    layout = _layout(kind)

    shape = _PACKED_SHAPE if layout.packed else _BATCH_SHAPE

    seqs, targets = torch.randint(1, 1024, (2, *shape), generator=torch.Generator().manual_seed(2))

    def step(module: Module) -> Tensor:
        loss: Tensor = module(seqs, layout, targets, reduction="sum")

        return loss

    def run(step: Callable[[Module], Tensor], module: Module) -> dict[str, Tensor]:
        loss = step(module)

        statistics = collect_moe_statistics(module)

        assert statistics is not None

        (loss + statistics.load_balancing_loss).backward()

        results = {"loss": loss.detach(), "load_balancing_loss": statistics.load_balancing_loss.detach()}

        return results | {f"d{name}": p.grad for name, p in module.named_parameters() if p.grad is not None}

    torch._dynamo.reset()

    expected = run(step, model)

    actual = run(torch.compile(step, backend="aot_eager", fullgraph=True), compiled_model)

    # The gradients of the decay parameters sum over all tokens of the
    # summed loss: measured up to 2e-5 of their largest entry.
    _assert_close(expected, actual, 1e-4)


def test_packed_gated_deltanet_layer_compiles_a_bounded_number_of_graphs() -> None:
    # Six packings, each of other documents: the first compiles the layer,
    # the second (more tokens) compiles it again with the number of tokens
    # dynamic, the third (more documents) with the number of documents
    # dynamic too; from then on no packing compiles anything. In fp64, where
    # a reordering of the sums leaves only rounding (fp32 left up to 2e-3 of
    # the decay gradients under inductor, which cancel over all tokens).
    layer = _make_model().decoder.layers[0].linear_attn

    assert layer is not None

    layer = layer.double()

    compiled_layer = copy.deepcopy(layer)

    def step(module: Module, x: Tensor, layout: BatchLayout, varlen: VarlenMetadata) -> Tensor:
        y: Tensor = module(x, layout, varlen=varlen)

        return y

    compiled_step = torch.compile(step, backend="aot_eager", fullgraph=True)

    packings = [[54, 6, 34, 66, 63], [39, 62, 46, 75, 38], [18, 37, 18, 13, 80, 33], [78, 19, 40, 13], [1, 88], [64, 64, 1, 7]]

    torch._dynamo.reset()

    graphs = []

    for lengths in packings:
        layout = BatchLayout((sum(lengths),), lengths, packed=True)

        # As the decoder makes it once per batch.
        varlen = VarlenMetadata.from_batch_layout(layout, torch.device("cpu"))

        generator = torch.Generator().manual_seed(len(graphs))

        x = torch.randn((sum(lengths), _MODEL_DIM), generator=generator, dtype=torch.float64)

        cotangent = torch.randn(x.shape, generator=generator, dtype=torch.float64)

        results = []

        for run_step, module in ((step, layer), (compiled_step, compiled_layer)):
            module.zero_grad()

            x_ = x.clone().requires_grad_()

            y = run_step(module, x_, layout, varlen)

            (y * cotangent).sum().backward()

            assert x_.grad is not None

            grads = {f"d{name}": p.grad for name, p in module.named_parameters() if p.grad is not None}

            results.append({"y": y.detach(), "dx": x_.grad} | grads)

        _assert_close(results[0], results[1], 1e-10)

        graphs.append(compiled_graph_count())

    assert graphs == [graphs[0], graphs[0] + 1, graphs[0] + 2] + [graphs[0] + 2] * 3, graphs
