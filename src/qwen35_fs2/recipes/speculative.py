"""Greedy decoding of one prompt, plainly or speculatively with the MTP head.

Speculative decoding with one MTP draft per step, as vLLM serves Qwen3.5:
the trunk's pass over the last accepted token ``x_p`` and the head's draft
``d`` of the token after it yields the trunk's greedy tokens at ``p + 1`` and
``p + 2``; if the first equals ``d`` the step gives two tokens for one trunk
pass, otherwise it gives the trunk's token at ``p + 1``.

A rejected draft has entered the trunk's incremental state: the keys and
values of the full-attention layers (which a shorter cache forgets) and the
recurrent and convolution states of the Gated DeltaNet layers (which cannot
forget a token). The decoder keeps the state from before the verifying pass
and, on rejection, goes back to it and passes ``x_p`` alone, the pass plain
decoding makes, so that rejected steps choose their token exactly as plain
greedy decoding does. Only an accepted draft is chosen from a two-token pass,
whose floating-point sums may differ from two one-token passes in the last
bits.

The MTP head never sees a rejected token: at position ``t`` it takes the
trunk's output at ``t`` and the token at ``t + 1``, both final when it runs.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import cast, final

import torch
from torch import Tensor
from torch.nn import Module

from fairseq2.data.tokenizers import VocabularyInfo
from fairseq2.error import InternalError
from fairseq2.models.transformer import FullAttentionState
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout, IncrementalState, IncrementalStateBag

from qwen35_fs2.nn.attention import Qwen35Attention
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet, GatedDeltaNetState
from qwen35_fs2.nn.mtp import Qwen35MultiTokenPredictor


@final
@dataclass(frozen=True)
class DecodingOutput:
    """The greedy response to one prompt and what it cost."""

    tokens: Tensor
    """The generated tokens, the end-of-sequence token included if generated.
    *Shape:* :math:`(S_{gen})`."""

    drafts: Tensor
    """The MTP head's draft of each generated token that the trunk verified
    one, -1 for the others (all in plain decoding). *Shape:* that of
    ``tokens``."""

    num_trunk_passes: int
    """The number of forward passes of the trunk, the prompt's included."""

    num_accepted: int
    """Of the drafts, the number the trunk accepted."""

    elapsed_time: float
    """The wall-clock seconds of the decoding."""

    @property
    def num_drafts(self) -> int:
        """The number of drafts the trunk verified (0 in plain decoding)."""
        return int((self.drafts >= 0).sum())


@final
class GreedyDecoder:
    """Decodes one prompt at a time greedily, plainly (:meth:`plain`) or
    speculatively with the MTP head (:meth:`speculative`); both give the same
    tokens (see the module docstring for where the last bits may differ).

    As fairseq2's sequence generators, the decoder never chooses the pad
    token, and it stops after the end-of-sequence token (or any of
    ``stop_indices``) or ``max_gen_len`` tokens, or when the sequence
    reaches ``max_seq_len`` (the model's, or a smaller one given).
    """

    def __init__(
        self,
        model: TransformerLM,
        vocab_info: VocabularyInfo,
        *,
        max_gen_len: int,
        max_seq_len: int | None = None,
        mtp: Qwen35MultiTokenPredictor | None = None,
        stop_indices: Collection[int] = (),
    ) -> None:
        """
        :param max_seq_len: The most tokens of a prompt and its response, as
            fairseq2's generators take it (capped by the model's
            ``max_seq_len``); ``None`` for the model's.
        :param stop_indices: Tokens that end a response besides the
            end-of-sequence token.
        """
        if max_gen_len < 1:
            raise ValueError(
                f"`max_gen_len` must be greater than or equal to 1, but is {max_gen_len} instead."
            )

        if vocab_info.eos_idx is None:
            raise ValueError("`vocab_info.eos_idx` must be set for greedy decoding, but is `None`.")

        embed = model.decoder_frontend.embed  # type: ignore[union-attr]

        if not isinstance(embed, Module):
            raise InternalError(f"`model.decoder_frontend.embed` is of type `{type(embed)}`.")

        self._model = model
        self._embed = embed
        self._mtp = mtp
        self._stop_indices = frozenset([vocab_info.eos_idx, *stop_indices])
        self._pad_idx = vocab_info.pad_idx
        self._max_gen_len = max_gen_len

        model_max_seq_len = cast(int, model.max_seq_len)

        self._max_seq_len = model_max_seq_len if max_seq_len is None else min(max_seq_len, model_max_seq_len)

        # The modules that keep an incremental state, to save and restore it.
        self._stateful = [
            m for m in model.decoder.modules() if isinstance(m, Qwen35Attention | GatedDeltaNet)
        ]

    @torch.inference_mode()
    def plain(self, prompt: Tensor) -> DecodingOutput:
        """Decodes ``prompt`` one token per trunk pass.

        :param prompt: *Shape:* :math:`(S_{prm})`.
        """
        start = time.perf_counter()

        max_gen_len = self._check_prompt(prompt)

        state_bag = self._new_state_bag(prompt, max_gen_len)

        token = self._greedy(self._run_trunk(prompt, state_bag)[-1:])

        tokens = [token]

        while not self._done(tokens, max_gen_len):
            token = self._greedy(self._run_trunk(token, state_bag))

            tokens.append(token)

        return self._output(tokens, [], len(tokens), 0, start)

    @torch.inference_mode()
    def speculative(self, prompt: Tensor) -> DecodingOutput:
        """Decodes ``prompt`` with one MTP draft per trunk pass.

        :param prompt: *Shape:* :math:`(S_{prm})`.
        """
        if self._mtp is None:
            raise InternalError("The decoder has no MTP head.")

        start = time.perf_counter()

        max_gen_len = self._check_prompt(prompt)

        state_bag = self._new_state_bag(prompt, max_gen_len)

        mtp_state_bag = self._new_state_bag(prompt, max_gen_len)

        hidden = self._run_trunk(prompt, state_bag)

        token = self._greedy(hidden[-1:])

        tokens = [token]

        # The head's pass over the prompt: at t its input is the token at
        # t + 1, the prompt's, then the first generated one.
        draft = self._draft(hidden, torch.cat([prompt[1:], token]), mtp_state_bag)

        # The draft of each generated token that has one.
        drafts: list[tuple[int, Tensor]] = []

        num_trunk_passes, num_accepted = 1, 0

        while not self._done(tokens, max_gen_len):
            saved = self._save_state(state_bag)

            # The trunk's outputs at p and p + 1.
            hidden = self._run_trunk(torch.cat([token, draft]), state_bag)

            num_trunk_passes += 1

            drafts.append((len(tokens), draft))

            verified = self._greedy(hidden)

            if torch.equal(verified[:1], draft):
                num_accepted += 1

                tokens.append(draft)

                if self._done(tokens, max_gen_len):
                    break

                token = verified[1:]

                tokens.append(token)

                # At p its input is the accepted draft, at p + 1 the token
                # after it.
                draft = self._draft(hidden, torch.cat([draft, token]), mtp_state_bag)
            else:
                state_bag = self._restore_state(saved)

                # The pass plain decoding makes.
                hidden = self._run_trunk(token, state_bag)

                num_trunk_passes += 1

                token = self._greedy(hidden)

                tokens.append(token)

                draft = self._draft(hidden, token, mtp_state_bag)

        return self._output(tokens, drafts, num_trunk_passes, num_accepted, start)

    def _check_prompt(self, prompt: Tensor) -> int:
        """Returns the number of tokens ``prompt`` leaves room for."""
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(
                f"`prompt` must be a non-empty one-dimensional tensor, but is of shape {tuple(prompt.shape)} instead."
            )

        room = self._max_seq_len - prompt.numel()

        if room < 1:
            raise ValueError(
                f"The length of `prompt` must be less than `max_seq_len` ({self._max_seq_len}), but is {prompt.numel()} instead."
            )

        return min(self._max_gen_len, room)

    @staticmethod
    def _new_state_bag(prompt: Tensor, max_gen_len: int) -> IncrementalStateBag:
        # Room for the draft past the last token.
        return IncrementalStateBag(prompt.numel() + max_gen_len + 2)

    def _done(self, tokens: list[Tensor], max_gen_len: int) -> bool:
        return len(tokens) >= max_gen_len or int(tokens[-1]) in self._stop_indices

    def _run_trunk(self, seqs: Tensor, state_bag: IncrementalStateBag) -> Tensor:
        """Passes ``seqs`` through the trunk after the tokens of
        ``state_bag``; returns its output after the final norm, the input of
        the output projection. *Shape:* :math:`(S,M)`."""
        model = self._model

        # (S) -> (1, S)
        seqs = seqs.unsqueeze(0)

        seqs_layout = BatchLayout.of(seqs)

        embeds, embeds_layout = model.decoder_frontend(seqs, seqs_layout, state_bag=state_bag)

        hidden = model.decoder(embeds, embeds_layout, state_bag=state_bag)

        state_bag.increment_step_nr(seqs.size(1))

        return hidden.squeeze(0)

    def _draft(self, hidden: Tensor, next_tokens: Tensor, state_bag: IncrementalStateBag) -> Tensor:
        """Passes the trunk's outputs ``hidden`` and the tokens that follow
        them through the MTP head; returns its draft of the token after the
        last of ``next_tokens``. *Shape:* :math:`(1)`."""
        if self._mtp is None:
            raise InternalError("The decoder has no MTP head.")

        # (S, M) -> (1, S, M)
        hidden = hidden.unsqueeze(0)

        next_embeds = self._embed(next_tokens.unsqueeze(0))

        output = self._mtp(hidden, next_embeds, BatchLayout.of(hidden), state_bag=state_bag)

        state_bag.increment_step_nr(hidden.size(1))

        return self._greedy(output[0, -1:])

    def _greedy(self, hidden: Tensor) -> Tensor:
        """Returns the most likely token after each position of ``hidden``,
        never the pad token. *Shape:* :math:`(S)`."""
        logits = self._model.final_proj(hidden)

        if self._pad_idx is not None:
            logits[..., self._pad_idx] = -torch.inf

        return logits.argmax(-1)

    def _save_state(self, state_bag: IncrementalStateBag) -> _SavedState:
        """Returns what :meth:`_restore_state` needs to go back to the state
        of ``state_bag`` now.

        Nothing is copied: appending to a key-value cache never overwrites
        the keys and values it has, and a Gated DeltaNet layer replaces its
        state rather than updating it.
        """
        states: dict[Module, IncrementalState | tuple[Tensor, Tensor]] = {}

        for module in self._stateful:
            state = state_bag.maybe_get_state(module, IncrementalState)

            if isinstance(state, FullAttentionState):
                states[module] = state.get()
            elif isinstance(state, GatedDeltaNetState):
                states[module] = state
            else:
                raise InternalError(f"The state of `{module}` is of type `{type(state)}`, which the decoder cannot restore.")

        return _SavedState(state_bag.step_nr, state_bag.max_num_steps, states)

    @staticmethod
    def _restore_state(saved: _SavedState) -> IncrementalStateBag:
        """Returns a state bag in the state of ``saved``."""
        state_bag = IncrementalStateBag(saved.max_num_steps)

        state_bag.increment_step_nr(saved.step_nr)

        for module, state in saved.states.items():
            if isinstance(state, tuple):
                # A new cache with the saved keys and values.
                state = FullAttentionState(*state, saved.max_num_steps, None)

            state_bag.set_state(module, state)

        return state_bag

    @staticmethod
    def _output(
        tokens: list[Tensor],
        drafts: list[tuple[int, Tensor]],
        num_trunk_passes: int,
        num_accepted: int,
        start: float,
    ) -> DecodingOutput:
        seqs = torch.cat(tokens)

        draft_seqs = torch.full_like(seqs, -1)

        for idx, draft in drafts:
            draft_seqs[idx] = draft

        return DecodingOutput(seqs, draft_seqs, num_trunk_passes, num_accepted, time.perf_counter() - start)


@final
@dataclass(frozen=True)
class _SavedState:
    step_nr: int
    max_num_steps: int
    states: dict[Module, IncrementalState | tuple[Tensor, Tensor]]
