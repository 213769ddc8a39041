"""The document offsets of a packed batch are made once per forward pass and
reach every Gated DeltaNet layer: no layer reads them back from the device,
and fla's varlen helpers are computed once per forward, not once per layer."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import Tensor

from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout

import qwen35_fs2
from fla_interpreter import fla_test_device
from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config
from qwen35_fs2.ops.backend import fla_unavailable_reason
from qwen35_fs2.ops.varlen import VarlenMetadata

_PACKAGE_DIR = Path(qwen35_fs2.__file__).parent

_LENGTHS = [5, 1, 70, 20]


class TestVarlenMetadata:
    def test_holds_the_offsets_on_both_sides(self) -> None:
        varlen = VarlenMetadata([0, 3, 3, 10], torch.device("cpu"))

        assert varlen.lengths == (3, 0, 7)
        assert varlen.num_seqs == 3
        assert varlen.num_tokens == 10
        assert varlen.cu_seqlens.dtype == torch.int64
        assert varlen.cu_seqlens_cpu.tolist() == [0, 3, 3, 10]

    def test_treats_the_padded_tail_of_a_packed_layout_as_a_document(self) -> None:
        layout = BatchLayout((12,), [3, 5], packed=True)

        varlen = VarlenMetadata.from_batch_layout(layout, torch.device("cpu"))

        assert varlen.cu_seqlens_cpu.tolist() == [0, 3, 8, 12]

    def test_derives_each_value_once(self) -> None:
        varlen = VarlenMetadata([0, 4], torch.device("cpu"))

        calls = []

        def make() -> int:
            calls.append(1)

            return 7

        assert varlen.derived("x", make) == 7
        assert varlen.derived("x", make) == 7

        assert len(calls) == 1

    @pytest.mark.parametrize(
        "offsets,match", [([2, 10], "must start at 0"), ([0], "at least 2 offsets"), ([0, 6, 4], "must be non-decreasing")]
    )
    def test_raises_error_when_offsets_are_inconsistent(self, offsets: list[int], match: str) -> None:
        with pytest.raises(ValueError, match=match):
            VarlenMetadata(offsets, torch.device("cpu"))


def _make_model(num_layers: int, backend: str) -> TransformerLM:
    torch.manual_seed(0)

    config = tiny_qwen35_config()

    # Gated DeltaNet layers only: what differs is their number.
    config.num_layers = num_layers
    config.layer_types = ["linear_attention"] * num_layers
    config.gdn_backend = backend  # type: ignore[assignment]

    return create_qwen35_model(config)


def _run_packed(model: TransformerLM, lengths: list[int]) -> None:
    width = sum(lengths) + 3

    seqs = torch.randint(1, 1024, (width,), generator=torch.Generator().manual_seed(1))

    layout = BatchLayout((width,), lengths, packed=True)

    logits = model(seqs, layout)

    logits.float().square().mean().backward()


@contextmanager
def _count_host_reads_in_package() -> Iterator[list[str]]:
    """Records every ``Tensor.tolist``/``Tensor.item`` called from the
    package's own code (a device synchronization on CUDA)."""
    calls: list[str] = []

    originals = {name: getattr(Tensor, name) for name in ("tolist", "item")}

    def counting(name: str) -> Callable[..., object]:
        original = originals[name]

        def wrapper(self: Tensor, *args: object, **kwargs: object) -> object:
            # The caller's frame alone: `inspect.stack()` reads a line of
            # source for every frame of the stack, at each of the thousands
            # of calls Triton's interpreter makes (minutes of the test).
            frame = inspect.currentframe()

            assert frame is not None and frame.f_back is not None

            filename, lineno = frame.f_back.f_code.co_filename, frame.f_back.f_lineno

            if Path(filename).is_relative_to(_PACKAGE_DIR):
                calls.append(f"{name} at {filename}:{lineno}")

            return original(self, *args, **kwargs)

        return wrapper

    try:
        for name in originals:
            setattr(Tensor, name, counting(name))

        yield calls
    finally:
        for name, original in originals.items():
            setattr(Tensor, name, original)


class TestPackedForwardOfTheTorchBackend:
    def test_no_layer_reads_offsets_back_from_the_device(self) -> None:
        model = _make_model(3, "torch")

        with _count_host_reads_in_package() as calls:
            _run_packed(model, _LENGTHS)

        assert calls == []

    def test_builds_its_index_tensors_once_per_forward(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import qwen35_fs2.ops.causal_conv as conv_module
        import qwen35_fs2.ops.delta_rule.chunk as chunk_module

        counts: dict[str, list[int]] = {}

        for num_layers in (1, 3):
            built = {"chunks": 0, "history": 0}

            def counted(cls: type, key: str) -> Callable[..., object]:
                original = cls.packed

                def packed(*args: object, **kwargs: object) -> object:
                    built[key] += 1

                    return original(*args, **kwargs)

                return staticmethod(packed)

            with monkeypatch.context() as patch:
                patch.setattr(chunk_module._ChunkLayout, "packed", counted(chunk_module._ChunkLayout, "chunks"))
                patch.setattr(conv_module._HistoryLayout, "packed", counted(conv_module._HistoryLayout, "history"))

                _run_packed(_make_model(num_layers, "torch"), _LENGTHS)

            counts[f"{num_layers} layers"] = [built["chunks"], built["history"]]

        assert counts == {"1 layers": [1, 1], "3 layers": [1, 1]}


@pytest.mark.skipif(fla_test_device() is None, reason="the fla kernels need a CUDA device or Triton's interpreter")
class TestPackedForwardOfTheFlaBackend:
    @pytest.fixture(autouse=True)
    def require_fla(self) -> None:
        reason = fla_unavailable_reason()

        if reason is not None:
            pytest.skip(f"the fla backend is unavailable: {reason}")

        if fla_test_device() != torch.device("cpu"):
            pytest.skip("counted on the CPU under Triton's interpreter")

    @pytest.mark.filterwarnings("ignore::RuntimeWarning")
    def test_computes_fla_varlen_helpers_once_per_forward(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # fla derives its chunk indices and sequence ids through
        # `_segmented_arange`, only when its tensor cache misses.
        import fla.ops.utils.index as fla_index  # type: ignore[import-untyped]

        counts = {}

        for num_layers in (1, 2):
            calls = []

            original = fla_index._segmented_arange

            def counted(*args: object) -> object:
                calls.append(1)

                return original(*args)

            with monkeypatch.context() as patch:
                patch.setattr(fla_index, "_segmented_arange", counted)

                model = _make_model(num_layers, "fla")

                with _count_host_reads_in_package() as host_reads:
                    # Fewer documents and chunks than `_LENGTHS`, for
                    # Triton's interpreter: a short document, one over two
                    # chunks, the padded tail.
                    _run_packed(model, [5, 70])

            assert host_reads == []

            counts[num_layers] = len(calls)

        assert counts[1] > 0

        assert counts[2] == counts[1]
