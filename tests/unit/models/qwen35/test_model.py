from __future__ import annotations

import pytest
import torch

from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout
from fairseq2.nn.utils.module import reset_non_persistent_buffers, to_empty

from qwen35_fs2.models.qwen35 import Qwen35Config, create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet


def _make_model(config: Qwen35Config | None = None, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)

    model = create_qwen35_model(config or tiny_qwen35_config())

    # Non-trivial norm weights, so that mistakes in them show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))

    return model.eval()


class TestQwen35Model:
    def test_meta_construction_materializes_like_a_direct_one(self) -> None:
        config = tiny_qwen35_config()

        with torch.device("meta"):
            model = create_qwen35_model(config)

        assert all(p.device.type == "meta" for p in model.parameters())

        to_empty(model, torch.device("cpu"))

        model.load_state_dict(_make_model(config).state_dict())

        reset_non_persistent_buffers(model)

        seqs = torch.randint(1, config.vocab_size, (2, 9))

        expected = _make_model(config)(seqs, BatchLayout.of(seqs))

        torch.testing.assert_close(model.eval()(seqs, BatchLayout.of(seqs)), expected)

    def test_dispatches_layer_types(self) -> None:
        config = tiny_qwen35_config()

        config.layer_types = ["full_attention", "linear_attention", "full_attention", "linear_attention"]

        model = create_qwen35_model(config)

        kinds = [
            "linear" if layer.linear_attn is not None else "full"  # type: ignore[union-attr]
            for layer in model.decoder.layers
        ]

        assert kinds == ["full", "linear", "full", "linear"]

        keys = model.state_dict().keys()

        assert "decoder.layers.0.self_attn.q_proj.weight" in keys
        assert "decoder.layers.1.linear_attn.decay.A_log" in keys
        assert not any(k.startswith("decoder.layers.0.linear_attn") for k in keys)

    def test_packed_batch_equals_documents_run_separately(self) -> None:
        model = _make_model()

        lengths = [1, 3, 7, 5]

        # A padded tail after the last document, as fairseq2's packer leaves.
        seqs = torch.randn(sum(lengths) + 4, 64)

        layout = BatchLayout((seqs.size(0),), lengths, packed=True)

        packed_input = seqs.clone().requires_grad_()

        packed_out = model.decoder(packed_input, layout)

        # A random direction keeps the gradients of order one.
        cotangent = torch.randn_like(packed_out)

        cotangent[sum(lengths) :] = 0.0

        (packed_out * cotangent).sum().backward()

        assert packed_input.grad is not None

        offset = 0

        for n in lengths:
            doc_input = seqs[offset : offset + n].unsqueeze(0).requires_grad_()

            doc_out = model.decoder(doc_input, BatchLayout.of(doc_input))

            (doc_out[0] * cotangent[offset : offset + n]).sum().backward()

            assert doc_input.grad is not None

            torch.testing.assert_close(packed_out[offset : offset + n], doc_out[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(packed_input.grad[offset : offset + n], doc_input.grad[0], atol=1e-5, rtol=1e-5)

            offset += n

    def test_documents_of_a_packed_batch_do_not_see_each_other(self) -> None:
        model = _make_model()

        lengths = [4, 7, 5]

        seqs = torch.randn(sum(lengths) + 3, 64)

        layout = BatchLayout((seqs.size(0),), lengths, packed=True)

        # Change everything but the second document, the padded tail too.
        other = torch.randn_like(seqs)

        other[4:11] = seqs[4:11]

        outputs = []

        for x in (seqs, other):
            x = x.clone().requires_grad_()

            out = model.decoder(x, layout)

            out[4:11].sum().backward()

            assert x.grad is not None

            outputs.append((out[4:11], x.grad[4:11]))

        # Bitwise: any leak, however small, changes the result.
        assert torch.equal(outputs[0][0], outputs[1][0])
        assert torch.equal(outputs[0][1], outputs[1][1])

    def test_padded_batch_equals_unpadded_singles(self) -> None:
        model = _make_model()

        lengths = [6, 2, 9]

        seqs = torch.zeros((3, 9), dtype=torch.int64)

        for idx, n in enumerate(lengths):
            seqs[idx, :n] = torch.randint(1, 1024, (n,))

        logits = model(seqs, BatchLayout(seqs.shape, lengths))

        for idx, n in enumerate(lengths):
            single = seqs[idx : idx + 1, :n]

            expected = model(single, BatchLayout.of(single))

            torch.testing.assert_close(logits[idx, :n], expected[0], atol=1e-5, rtol=1e-5)


class TestGatedDeltaNet:
    def test_raises_error_when_packed_layout_does_not_match_seqs(self) -> None:
        layer = GatedDeltaNet(32, 2, 4, 8, 8, 4)

        seqs = torch.randn(10, 32)

        layout = BatchLayout((12,), [5, 7], packed=True)

        with pytest.raises(ValueError, match=r"must be of shape \(T=12, M\) to match its packed layout"):
            layer(seqs, layout)
