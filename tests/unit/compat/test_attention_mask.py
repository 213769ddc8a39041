"""Pins what ``qwen35_fs2.compat.attention_mask`` works around and relies on:
fairseq2's ``TorchSDPA`` breaks the graph of a compiled function on a packed
or padded batch, even with the mask already cached; the precomputed mask
gives what ``TorchSDPA`` gives, bit for bit, in fp32, bf16 and under bf16
autocast, forward and backward, and compiles without a break."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import torch._dynamo.testing
from torch import Tensor
from torch.nn import ModuleList

from fairseq2.models.transformer import (
    AttentionBiasCache,
    CausalAttentionBias,
    NaiveSDPA,
    TorchSDPA,
    materialize_attention_bias,
)
from fairseq2.nn import BatchLayout

from qwen35_fs2.compat.attention_mask import (
    PrecomputedMaskCache,
    make_attention_bias_cache,
    run_sdpa,
)

_HEADS, _HEAD_DIM = 4, 16


_SHAPES = {"padded": (2, 70), "packed": (140,)}


def _layout(kind: str) -> BatchLayout:
    if kind == "padded":
        return BatchLayout(_SHAPES[kind], [70, 41])

    # Three documents and a padded tail.
    return BatchLayout(_SHAPES[kind], [5, 64, 60], packed=True)


def _qkv(layout: BatchLayout, dtype: torch.dtype) -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)

    shape = (*_SHAPES["packed" if layout.packed else "padded"], _HEADS, _HEAD_DIM)

    return [torch.randn(shape, generator=generator).to(dtype).requires_grad_() for _ in range(3)]


def _attend(
    sdpa: TorchSDPA, layout: BatchLayout, dtype: torch.dtype, make_cache: Callable[[Tensor], AttentionBiasCache]
) -> list[Tensor]:
    """The output and the gradients of ``q``, ``k``, ``v``."""
    q, k, v = _qkv(layout, dtype)

    out = run_sdpa(sdpa, q, layout, k, layout, v, make_cache(q))

    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)

    (out * cotangent).sum().backward()

    assert q.grad is not None and k.grad is not None and v.grad is not None

    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_torch_sdpa_breaks_the_graph_even_with_a_cached_mask(kind: str) -> None:
    layout = _layout(kind)

    sdpa = TorchSDPA(CausalAttentionBias())

    q, k, v = (t.detach() for t in _qkv(layout, torch.float32))

    cache = AttentionBiasCache()

    # Caches the mask.
    sdpa(q, layout, k, layout, v, cache)

    def attend(q: Tensor) -> Tensor:
        attns, _ = sdpa(q, layout, k, layout, v, cache)

        return attns

    torch._dynamo.reset()

    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(attend, backend="eager", fullgraph=True)(q)


@pytest.mark.parametrize("kind", ["packed", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_the_precomputed_mask_gives_what_torch_sdpa_gives(
    kind: str, dtype: torch.dtype | str, scale: float | None
) -> None:
    layout = _layout(kind)

    sdpa = TorchSDPA(CausalAttentionBias(), scale=scale)

    layers = ModuleList([sdpa])

    tensor_dtype = torch.float32 if dtype == "autocast" else dtype

    assert isinstance(tensor_dtype, torch.dtype)

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
        expected = _attend(sdpa, layout, tensor_dtype, lambda _: AttentionBiasCache())

        def precomputed(q: Tensor) -> AttentionBiasCache:
            cache = make_attention_bias_cache(layers, q, layout, incremental=False)

            assert isinstance(cache, PrecomputedMaskCache)

            return cache

        actual = _attend(sdpa, layout, tensor_dtype, precomputed)

    for name, a, e in zip(["out", "dq", "dk", "dv"], actual, expected):
        assert a.dtype == e.dtype, name

        assert torch.equal(a, e), (name, (a - e).abs().max())


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_the_precomputed_mask_compiles_without_a_graph_break(kind: str) -> None:
    layout = _layout(kind)

    sdpa = TorchSDPA(CausalAttentionBias())

    q, k, v = (t.detach() for t in _qkv(layout, torch.float32))

    cache = make_attention_bias_cache(ModuleList([sdpa]), q, layout, incremental=False)

    def attend(q: Tensor) -> Tensor:
        return run_sdpa(sdpa, q, layout, k, layout, v, cache)

    torch._dynamo.reset()

    actual = torch.compile(attend, backend="eager", fullgraph=True)(q)

    expected, _ = sdpa(q, layout, k, layout, v, AttentionBiasCache())

    assert torch.equal(actual, expected)


def test_fairseq2s_cache_where_no_mask_is_precomputed() -> None:
    layout = _layout("packed")

    q = torch.zeros(140, _HEADS, _HEAD_DIM)

    torch_sdpa = ModuleList([TorchSDPA(CausalAttentionBias())])

    # Decoding: the keys' layout is the key/value cache's.
    cache = make_attention_bias_cache(torch_sdpa, q, layout, incremental=True)

    assert type(cache) is AttentionBiasCache

    # Another SDPA, or a bias that is not plainly causal, makes its own mask.
    for sdpa in (NaiveSDPA(CausalAttentionBias()), TorchSDPA(CausalAttentionBias(attn_window_len=8))):
        cache = make_attention_bias_cache(ModuleList([sdpa]), q, layout, incremental=False)

        assert type(cache) is AttentionBiasCache

    # A full batch runs `is_causal`, without a mask.
    full = BatchLayout((2, 70), None)

    cache = make_attention_bias_cache(torch_sdpa, q, full, incremental=False)

    assert type(cache) is AttentionBiasCache


def _random_layouts(count: int) -> list[BatchLayout]:
    """Packed batches of 1 to 6 documents with and without a padded tail
    (one-token documents among them), and padded batches of 1 to 4
    sequences (one-token ones among them), all of them with a mask."""
    rng = random.Random(0)

    layouts: list[BatchLayout] = []

    while len(layouts) < count:
        if rng.random() < 0.5:
            width = rng.randint(1, 40)

            seq_lens = [rng.randint(1, width)]

            while sum(seq_lens) < width and len(seq_lens) < 6:
                seq_lens.append(rng.randint(1, width - sum(seq_lens)))

            # A padded tail in about half of them.
            if rng.random() < 0.5 and len(seq_lens) > 1:
                seq_lens.pop()

            layout = BatchLayout((width,), seq_lens, packed=True)
        else:
            width, batch_size = rng.randint(2, 30), rng.randint(1, 4)

            layout = BatchLayout((batch_size, width), [rng.randint(1, width) for _ in range(batch_size)])

        # (`TorchSDPA` needs no mask for sequences of one token.)
        if layout.packed or (layout.padded and layout.max_seq_len > 1):
            layouts.append(layout)

    return layouts


def _batch(layout: BatchLayout, dtype: torch.dtype) -> Tensor:
    """A batch of 8-dimensional vectors of ``layout``'s shape."""
    shape = (layout.width,) if layout.packed else (len(layout.seq_lens), layout.width)

    return torch.zeros((*shape, 8), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_mask_is_fairseq2s_bit_for_bit(dtype: torch.dtype) -> None:
    layers = ModuleList([TorchSDPA(CausalAttentionBias())])

    for layout in _random_layouts(200):
        seqs = _batch(layout, dtype)

        cache = make_attention_bias_cache(layers, seqs, layout, incremental=False)

        assert isinstance(cache, PrecomputedMaskCache), layout

        expected = materialize_attention_bias(CausalAttentionBias(), layout, layout, seqs.device, dtype)

        actual = cache.causal_mask

        assert actual.shape == expected.shape and actual.dtype == expected.dtype, layout

        # Bit for bit: the same zeros (not -0.0) and infinities.
        assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)), layout


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_the_mask_is_made_in_a_compiled_function_without_a_break_or_a_recompilation_per_batch(kind: str) -> None:
    """As the MTP head makes it inside the recipes' compiled loss."""
    layers = ModuleList([TorchSDPA(CausalAttentionBias())])

    def make_mask(seqs: Tensor, layout: BatchLayout) -> Tensor:
        cache = make_attention_bias_cache(layers, seqs, layout, incremental=False)

        assert isinstance(cache, PrecomputedMaskCache)

        return cache.causal_mask * 2.0

    torch._dynamo.reset()

    counter = torch._dynamo.testing.CompileCounter()

    compiled = torch.compile(make_mask, backend=counter, fullgraph=True)

    # (Not a batch of width or size 1: dynamo specializes sizes 0 and 1.)
    batches = [(_batch(layout, torch.float32), layout) for layout in _random_layouts(60) if layout.packed == (kind == "packed")]

    batches = [(seqs, layout) for seqs, layout in batches if min(seqs.shape[:-1]) > 1]

    assert len(batches) >= 8

    for seqs, layout in batches[:8]:
        expected = materialize_attention_bias(CausalAttentionBias(), layout, layout, seqs.device, seqs.dtype)

        assert torch.equal(compiled(seqs, layout), expected * 2.0), layout

    # The first batch's shapes, then dynamic ones.
    assert counter.frame_count <= 2, counter.frame_count
