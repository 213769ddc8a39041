"""Incremental decoding through fairseq2's generators equals re-running the
whole sequence at every step."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from fairseq2.data.tokenizers import VocabularyInfo
from fairseq2.generation.beam_search import BeamSearchSequenceGenerator
from fairseq2.generation.sampling import SamplingSequenceGenerator, TopKSampler
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout

from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config

_PROMPT_LENS = (5, 11, 8)


def _make_model() -> TransformerLM:
    torch.manual_seed(0)

    config = tiny_qwen35_config()

    # Large enough weights that the next token depends on the context; with
    # the default init a tiny model repeats its last input token.
    config.init_std = 0.1

    model = create_qwen35_model(config)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))

    return model.eval()


def _make_prompts() -> tuple[list[Tensor], Tensor, BatchLayout]:
    generator = torch.Generator().manual_seed(1)

    prompts = [torch.randint(2, 1024, (n,), generator=generator) for n in _PROMPT_LENS]

    seqs = torch.zeros((len(prompts), max(_PROMPT_LENS)), dtype=torch.int64)

    for idx, prompt in enumerate(prompts):
        seqs[idx, : prompt.numel()] = prompt

    return prompts, seqs, BatchLayout(seqs.shape, list(_PROMPT_LENS))


@torch.no_grad()
def _full_forward_greedy(model: TransformerLM, prompt: Tensor, eos_idx: int | None, max_gen_len: int) -> list[int]:
    seq = prompt.unsqueeze(0)

    generated = []

    for _ in range(max_gen_len):
        logits = model(seq, BatchLayout.of(seq))

        token = int(logits[0, -1].argmax())

        generated.append(token)

        if token == eos_idx:
            break

        seq = torch.cat([seq, torch.tensor([[token]])], dim=1)

    return generated


class TestIncrementalDecoding:
    @pytest.mark.slow
    def test_greedy_sampling_equals_full_forward_argmax(self) -> None:
        model = _make_model()

        prompts, seqs, layout = _make_prompts()

        max_gen_len = 64

        # Make the second prompt stop early, so the generator drops it from
        # the batch (a state reorder) while the others go on: its EOS is a
        # token it emits first at some step, and that the others never emit.
        tokens = _full_forward_greedy(model, prompts[1], None, 16)

        others = {t for idx in (0, 2) for t in _full_forward_greedy(model, prompts[idx], None, max_gen_len + 1)}

        stop_step = next(i for i in range(2, 16) if tokens[i] not in tokens[:i] and tokens[i] not in others)

        eos_idx = tokens[stop_step]

        vocab_info = VocabularyInfo(size=1024, unk_idx=None, bos_idx=None, eos_idx=eos_idx, pad_idx=0)

        generator = SamplingSequenceGenerator(
            model,
            vocab_info,
            TopKSampler(k=1),
            max_gen_len=max_gen_len,
            prefill_chunk_size=3,
            temperature=1.0,
        )

        output = generator(seqs, layout)

        for idx, (prompt, hypotheses) in enumerate(zip(prompts, output.hypotheses, strict=True)):
            seq = hypotheses[0].seq.tolist()

            # The generator ends every hypothesis with EOS, the ones that
            # reach the length limit too.
            assert seq[-1] == eos_idx

            expected = _full_forward_greedy(model, prompt, eos_idx, len(seq))

            if idx == 1:
                assert seq == expected and len(seq) == stop_step + 1
            else:
                assert len(seq) > max_gen_len

                assert seq[:-1] == expected[: len(seq) - 1]

    @pytest.mark.slow
    def test_beam_search_scores_equal_full_forward_log_probs(self) -> None:
        model = _make_model()

        prompts, seqs, layout = _make_prompts()

        vocab_info = VocabularyInfo(size=1024, unk_idx=None, bos_idx=None, eos_idx=1, pad_idx=0)

        # Beam search duplicates and reorders hypotheses at every step.
        generator = BeamSearchSequenceGenerator(
            model,
            vocab_info,
            beam_size=3,
            max_gen_len=24,
            prefill_chunk_size=4,
            normalize_scores=False,
        )

        output = generator(seqs, layout)

        with torch.no_grad():
            for prompt, hypotheses in zip(prompts, output.hypotheses, strict=True):
                assert len(hypotheses) == 3

                for hypothesis in hypotheses:
                    full = torch.cat([prompt, hypothesis.seq]).unsqueeze(0)

                    lprobs = torch.log_softmax(model(full, BatchLayout.of(full)).float(), dim=-1)

                    # The log probability of each generated token after the
                    # first (whose step score also holds the prompt's).
                    n = prompt.numel()

                    positions = torch.arange(n, full.size(1) - 1)

                    expected = lprobs[0, positions, full[0, positions + 1]]

                    assert hypothesis.step_scores is not None

                    torch.testing.assert_close(hypothesis.step_scores[1:], expected, atol=1e-4, rtol=1e-5)


def test_compiled_decoding_still_fails_as_the_generation_recipes_assume() -> None:
    """The generation recipes refuse ``model.compile: true`` because
    incremental decoding fails under ``torch.compile`` in torch 2.9 (the
    key-value cache's ``BatchLayout`` inside a compiled layer); when this
    test fails, decoding compiles and the refusal
    (:func:`~qwen35_fs2.recipes.generation.validate_response_model`) can go."""
    from fairseq2.models.transformer_lm import compile_transformer_lm

    model = _make_model()

    _, seqs, layout = _make_prompts()

    vocab_info = VocabularyInfo(size=1024, unk_idx=None, bos_idx=None, eos_idx=1, pad_idx=0)

    generator = SamplingSequenceGenerator(model, vocab_info, TopKSampler(k=1), max_gen_len=4, temperature=1.0)

    # The recipes' compilation, with dynamo alone (the failure is dynamo's).
    compile_transformer_lm(model, fullgraph=False, dynamic=None, mode="default", backend="eager", options=None)

    try:
        with pytest.raises(Exception, match="maybe_mark_dynamic"):
            with torch.no_grad():
                generator(seqs, layout)
    finally:
        torch._dynamo.reset()
