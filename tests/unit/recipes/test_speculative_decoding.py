"""Greedy speculative decoding with the MTP head gives, token for token, what
plain greedy decoding gives: ours, and fairseq2's own sampling generator with
top-1 sampling on a padded batch of prompts of mixed lengths (an independent
implementation of greedy decoding). Dense and MoE, 64 tokens.

The head's drafts decide only how many trunk passes a response takes, so the
test also checks that the drafts are the head's predictions: those of one
pass of the trunk and the head over the whole generated sequence, without
incremental state.

A random head's drafts are almost never accepted, which would leave the
accepting path untested. The head here is built to draft the trunk's own
next token (``fc`` passes the trunk's output through, its decoder layer's
residual branches are scaled down): the trunk accepts it where it repeats a
token, so each response mixes accepted and rejected drafts."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from fairseq2.data.tokenizers import VocabularyInfo
from fairseq2.generation.sampling import SamplingSequenceGenerator, TopKSampler
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout
from fairseq2.recipe.config import TOP_K_SAMPLER, SamplerChoice, SamplingConfig, SequenceGeneratorSection, TopKSamplerConfig
from fairseq2.recipe.error import RecipeError

from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config
from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model
from qwen35_fs2.models.qwen35_moe.config import Qwen35ExpertsConfig, Qwen35MoeConfig
from qwen35_fs2.nn.mtp import Qwen35MultiTokenPredictor, find_mtp
from qwen35_fs2.models.qwen35.tokenizer import Qwen35Tokenizer
from qwen35_fs2.recipes.generation import _create_speculative_decoder
from qwen35_fs2.recipes.speculative import DecodingOutput, GreedyDecoder

_PROMPT_LENS = (3, 17, 40)

_MAX_GEN_LEN = 64

_VOCAB_INFO = VocabularyInfo(size=1024, unk_idx=None, bos_idx=None, eos_idx=5, pad_idx=0)


def _make_model(kind: str) -> TransformerLM:
    config = tiny_qwen35_config()

    config.mtp_num_layers = 1

    # Large enough weights that the trunk does not repeat one token forever,
    # small enough that it often repeats one.
    config.init_std = 0.06

    torch.manual_seed(0)

    if kind == "dense":
        model = create_qwen35_model(config)
    else:
        fields = ("model_dim", "max_seq_len", "vocab_size", "pad_idx", "num_layers", "num_attn_heads", "num_key_value_heads", "head_dim", "num_linear_key_heads", "num_linear_value_heads", "linear_key_head_dim", "linear_value_head_dim", "mtp_num_layers", "init_std")

        moe_config = Qwen35MoeConfig(
            **{f: getattr(config, f) for f in fields},
            experts=Qwen35ExpertsConfig(num_experts=4, top_k=2, inner_dim=32, shared_expert_inner_dim=48),
        )

        model = create_qwen35_moe_model(moe_config)

    mtp = _get_mtp(model)

    model_dim = config.model_dim

    with torch.no_grad():
        # [embedding | hidden] -> hidden
        mtp.fc.weight.copy_(torch.cat([torch.zeros(model_dim, model_dim), torch.eye(model_dim)], dim=1))

        for name, param in mtp.layers.named_parameters():
            if name.endswith("output_proj.weight"):
                param.mul_(0.1)

    return model.eval()


def _get_mtp(model: TransformerLM) -> Qwen35MultiTokenPredictor:
    mtp = find_mtp(model)

    assert mtp is not None

    return mtp


def _make_prompts() -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)

    return [torch.randint(10, 1024, (n,), generator=generator) for n in _PROMPT_LENS]


def _fairseq2_greedy(model: TransformerLM, prompts: list[Tensor]) -> list[Tensor]:
    """fairseq2's greedy responses to ``prompts``, decoded as one right-padded
    batch; each cut to ``_MAX_GEN_LEN`` tokens (fairseq2 lets the shorter
    prompts of a batch generate more)."""
    seqs = torch.zeros((len(prompts), max(_PROMPT_LENS)), dtype=torch.int64)

    for idx, prompt in enumerate(prompts):
        seqs[idx, : prompt.numel()] = prompt

    # Beyond the 64 tokens compared, so that its forced end-of-sequence
    # token at the last step is not among them.
    generator = SamplingSequenceGenerator(model, _VOCAB_INFO, TopKSampler(k=1), max_gen_len=_MAX_GEN_LEN + 40)

    output = generator(seqs, BatchLayout(seqs.shape, list(_PROMPT_LENS)))

    return [hypotheses[0].seq[:_MAX_GEN_LEN] for hypotheses in output.hypotheses]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_speculative_decoding_gives_the_tokens_of_greedy_decoding(kind: str) -> None:
    model = _make_model(kind)

    prompts = _make_prompts()

    expected = _fairseq2_greedy(model, prompts)

    decoder = GreedyDecoder(model, _VOCAB_INFO, max_gen_len=_MAX_GEN_LEN, mtp=_get_mtp(model))

    num_drafts, num_accepted = 0, 0

    for prompt, expected_tokens in zip(prompts, expected):
        plain = decoder.plain(prompt)

        speculative = decoder.speculative(prompt)

        assert plain.tokens.tolist() == expected_tokens.tolist()

        assert speculative.tokens.tolist() == expected_tokens.tolist()

        assert plain.num_drafts == 0 and plain.num_trunk_passes == plain.tokens.numel()

        # Each accepted draft saves a pass, each rejected one costs one.
        rejected = speculative.num_drafts - speculative.num_accepted

        assert speculative.num_trunk_passes == 1 + speculative.num_drafts + rejected

        _check_drafts(model, prompt, speculative)

        num_drafts += speculative.num_drafts

        num_accepted += speculative.num_accepted

    # Both paths taken.
    assert 0 < num_accepted < num_drafts, (num_accepted, num_drafts)

    # All of the 64 tokens, except where a response ends before.
    assert sum(t.numel() for t in expected) > 2 * _MAX_GEN_LEN


@torch.no_grad()
def _check_drafts(model: TransformerLM, prompt: Tensor, output: DecodingOutput) -> None:
    """Checks that the drafts of ``output`` are those of one pass of the
    trunk and the head over the prompt and the response."""
    mtp = _get_mtp(model)

    # The prompt and the response but its last token.
    seqs = torch.cat([prompt, output.tokens])[:-1].unsqueeze(0)

    seqs_layout = BatchLayout.of(seqs)

    embeds, _ = model.decoder_frontend(seqs, seqs_layout)

    hidden = model.decoder(embeds, seqs_layout)

    # At t the head takes the token at t + 1 and predicts t + 2.
    next_tokens = torch.cat([seqs[:, 1:], output.tokens[-1:].unsqueeze(0)], dim=1)

    next_embeds = model.decoder_frontend.embed(next_tokens)  # type: ignore[operator, union-attr]

    logits = model.final_proj(mtp(hidden, next_embeds, seqs_layout))

    logits[..., _VOCAB_INFO.pad_idx] = -torch.inf

    predictions = logits.argmax(-1).squeeze(0)

    # The draft of generated token i comes from position P + i - 2.
    drafted = (output.drafts >= 0).nonzero().squeeze(-1)

    assert drafted.numel() == output.num_drafts > 0

    positions = prompt.numel() + drafted - 2

    assert output.drafts[drafted].tolist() == predictions[positions].tolist()


class TestStopIndices:
    def test_both_ways_stop_after_a_stop_token_as_after_eos(self) -> None:
        model = _make_model("dense")

        prompt = torch.tensor([3, 17, 42, 8], dtype=torch.int64)

        free = GreedyDecoder(model, _VOCAB_INFO, max_gen_len=_MAX_GEN_LEN, mtp=_get_mtp(model)).plain(prompt).tokens

        # The third token of the free run made a stop token: both ways end
        # right after it, with the same tokens.
        stop = int(free[2])

        assert stop not in free[:2].tolist() and stop != _VOCAB_INFO.eos_idx

        decoder = GreedyDecoder(model, _VOCAB_INFO, max_gen_len=_MAX_GEN_LEN, mtp=_get_mtp(model), stop_indices=[stop])

        assert decoder.plain(prompt).tokens.tolist() == free[:3].tolist()
        assert decoder.speculative(prompt).tokens.tolist() == free[:3].tolist()


class TestBadInput:
    def test_rejects_a_prompt_that_leaves_no_room(self) -> None:
        model = _make_model("dense")

        decoder = GreedyDecoder(model, _VOCAB_INFO, max_gen_len=4, mtp=_get_mtp(model))

        with pytest.raises(ValueError, match=r"length of `prompt` must be less than `max_seq_len` \(2048\), but is 2048 instead"):
            decoder.speculative(torch.ones(2048, dtype=torch.int64))

    def test_takes_the_generator_configs_max_seq_len_below_the_models(self) -> None:
        # As fairseq2's generators: a prompt of 12 tokens leaves room for 3
        # with `max_seq_len` 15, and one of 15 none.
        model = _make_model("dense")

        decoder = GreedyDecoder(model, _VOCAB_INFO, max_gen_len=8, max_seq_len=15, mtp=_get_mtp(model))

        prompt = torch.arange(2, 14)

        assert decoder.plain(prompt).tokens.numel() == 3
        assert decoder.speculative(prompt).tokens.numel() == 3

        with pytest.raises(ValueError, match=r"length of `prompt` must be less than `max_seq_len` \(15\), but is 15 instead"):
            decoder.speculative(torch.arange(2, 17))

    def test_rejects_a_max_gen_len_below_one(self) -> None:
        with pytest.raises(ValueError, match=r"`max_gen_len` must be greater than or equal to 1, but is 0 instead"):
            GreedyDecoder(_make_model("dense"), _VOCAB_INFO, max_gen_len=0)


class TestSpeculativeDecodingConfig:
    def test_a_minimum_response_length_is_refused(self, tokenizer: Qwen35Tokenizer) -> None:
        # fairseq2's generator holds the end token back for `min_gen_len`
        # tokens; the speculative decoder ends at the first one.
        section = SequenceGeneratorSection(
            name="sampling",
            config=SamplingConfig(sampler=SamplerChoice(name=TOP_K_SAMPLER, config=TopKSamplerConfig(k=1)), max_gen_len=16, min_gen_len=4),
        )

        with pytest.raises(RecipeError, match=r"^`seq_generator.config.min_gen_len` must be 1 when `speculative_decoding.enabled` is `True`, but is 4 instead\.$"):
            _create_speculative_decoder(torch.nn.Identity(), tokenizer, section)
