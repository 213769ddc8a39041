"""The multi-token-prediction (MTP) head of Qwen3.5.

Every released Qwen3.5 checkpoint ships one (``mtp.*``); vLLM and SGLang
draft tokens with it for speculative decoding. At position ``t`` it combines
the embedding of token ``t+1`` with the trunk's hidden state at ``t`` and
predicts token ``t+2`` through the model's own output projection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import final

import torch
from torch import Tensor
from torch.nn import Module, ModuleList

from fairseq2.nn import BatchLayout, IncrementalStateBag, LayerNorm, Projection

from qwen35_fs2.compat.attention_mask import make_attention_bias_cache
from qwen35_fs2.nn.decoder_layer import Qwen35DecoderLayer


@final
@dataclass(frozen=True)
class MtpLoss:
    """The loss of the MTP head on one batch."""

    nll_loss: Tensor
    """The summed cross entropy of the head's predictions (a scalar)."""

    num_targets: Tensor
    """The number of tokens it predicted: those two positions ahead in the
    same document, not padding, and in the target mask (a scalar)."""

    num_accepted: Tensor | None = None
    """Of those, the number of positions whose greedy draft equals the
    trunk's greedy token at the next position: what one-step MTP
    speculative decoding accepts (a scalar); computed in evaluation only."""


@final
class Qwen35MultiTokenPredictor(Module):
    """The MTP head, as vLLM's ``Qwen3_5MultiTokenPredictor`` defines it::

        x = fc(cat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))
        y = layer_norm(layers(x))

    ``h_t`` is the trunk's output at ``t`` after its final norm, the input of
    the output projection (what vLLM's target model hands its drafter), and
    ``y`` goes through that same output projection. The embedding and the
    output projection are the model's, so the head owns neither.

    ``layers`` are full-attention decoder layers (one in Qwen3.5) attending
    within the documents of ``seqs_layout``, as the trunk's do.
    """

    fc: Projection
    pre_fc_norm_embedding: LayerNorm
    pre_fc_norm_hidden: LayerNorm
    layer_norm: LayerNorm

    def __init__(
        self,
        fc: Projection,
        pre_fc_norm_embedding: LayerNorm,
        pre_fc_norm_hidden: LayerNorm,
        layers: Sequence[Qwen35DecoderLayer],
        layer_norm: LayerNorm,
    ) -> None:
        super().__init__()

        if fc.input_dim != 2 * fc.output_dim:
            raise ValueError(
                f"`fc.input_dim` must be twice `fc.output_dim` ({2 * fc.output_dim}), but is {fc.input_dim} instead."
            )

        self.fc = fc

        self.pre_fc_norm_embedding = pre_fc_norm_embedding

        self.pre_fc_norm_hidden = pre_fc_norm_hidden

        self.layers = ModuleList(layers)

        self.layer_norm = layer_norm

        self._batch_layout: BatchLayout | None = None

        self._loss: MtpLoss | None = None

    def set_batch_layout(self, seqs_layout: BatchLayout) -> None:
        """Records the layout of the model's input, for a loss computed from
        the trunk's output (:func:`pass_batch_layout_to_mtp`)."""
        self._batch_layout = seqs_layout

    def pop_batch_layout(self) -> BatchLayout:
        """Returns and clears the layout of :meth:`set_batch_layout`."""
        seqs_layout, self._batch_layout = self._batch_layout, None

        if seqs_layout is None:
            raise RuntimeError(
                "The MTP head has no batch layout. Register `pass_batch_layout_to_mtp` as a forward pre-hook of the model."
            )

        return seqs_layout

    def set_loss(self, loss: MtpLoss) -> None:
        self._loss = loss

    def pop_loss(self) -> MtpLoss | None:
        """Returns and clears the loss of the last forward pass, ``None`` if
        none was computed."""
        loss, self._loss = self._loss, None

        return loss

    def forward(
        self,
        hidden: Tensor,
        next_embeds: Tensor,
        seqs_layout: BatchLayout,
        *,
        state_bag: IncrementalStateBag | None = None,
    ) -> Tensor:
        """
        :param hidden: The trunk's output at each position (after its final
            norm). *Shape:* :math:`(N,S,M)`, or :math:`(S,M)` if packed.
        :param next_embeds: The embedding of the token that follows each
            position. *Shape:* Same as ``hidden``.
        :param seqs_layout: The layout of the trunk's input.
        :param state_bag: The head's own incremental state (the keys and
            values of its attention) when it drafts token by token in
            evaluation mode; its step number is the position of
            ``hidden``'s first element.

        :returns: The head's output at each position, to be projected to the
            logits of the token after the next one. *Shape:* Same as
            ``hidden``.
        """
        if next_embeds.shape != hidden.shape:
            raise ValueError(
                f"`next_embeds` must be of shape {tuple(hidden.shape)} to match `hidden`, but is of shape {tuple(next_embeds.shape)} instead."
            )

        # The embedding first, as in the released checkpoints' `fc`.
        seqs = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)

        seqs = self.fc(seqs)

        # The mask of a packed or padded batch is made here, inside the
        # recipes' compiled loss (it compiles), not before the model runs:
        # it would be held through the trunk's forward pass then, and for
        # steps whose loss does not run the head.
        attn_bias_cache = make_attention_bias_cache(
            self.layers, seqs, seqs_layout, incremental=state_bag is not None
        )

        for layer in self.layers:
            seqs = layer(seqs, seqs_layout, attn_bias_cache, state_bag=state_bag)

        return self.layer_norm(seqs)  # type: ignore[no-any-return]


def pass_batch_layout_to_mtp(
    model: Module, args: tuple[object, ...], kwargs: Mapping[str, object]
) -> None:
    """A forward pre-hook for models with an MTP head (``model.mtp``): hands
    the head the layout of the model's input, which a loss computed from the
    trunk's output (``TransformerLM.compute_fused_loss``) is not given.

    A module-level function, not a closure, so that copies of the model
    (``deepcopy``, pickling) keep working hooks.
    """
    seqs_layout = args[1] if len(args) > 1 else kwargs.get("seqs_layout")

    if not isinstance(seqs_layout, BatchLayout):
        raise TypeError(
            f"The second argument of the model must be a `BatchLayout`, but is of type `{type(seqs_layout).__name__}` instead."
        )

    mtp = model.mtp

    if not isinstance(mtp, Qwen35MultiTokenPredictor):
        raise TypeError(
            f"`model.mtp` must be a `Qwen35MultiTokenPredictor`, but is of type `{type(mtp).__name__}` instead."
        )

    mtp.set_batch_layout(seqs_layout)


def find_mtp(model: Module) -> Qwen35MultiTokenPredictor | None:
    """Returns the MTP head of ``model`` through activation-checkpoint, FSDP,
    DDP and ``torch.compile`` wrappers, ``None`` if it has none."""
    for module in model.modules():
        if isinstance(module, Qwen35MultiTokenPredictor):
            return module

    return None


def mtp_target_mask(seqs_layout: BatchLayout, target_mask: Tensor | None) -> Tensor:
    """Returns where the MTP head has a target, for the targets ``targets``
    of an auto-regressive batch (``targets[t]`` follows input ``t``): at
    input position ``t`` it predicts ``targets[t + 1]``, which counts if

    - position ``t + 1`` is in the document of ``t`` (not the next document,
      not padding), and
    - ``targets[t + 1]`` itself is: in a packed batch the target of a
      document's last position is the next document's first token;
    - ``target_mask[t + 1]`` is ``True``, if given (the response tokens in
      SFT).

    Targets equal to the pad index are left to the loss, as in the LM loss.

    :param target_mask: *Shape:* that of the batch.
    :returns: A boolean mask of the shape of the batch.
    """
    positions = seqs_layout.position_indices  # -1 at pads

    pads = positions.new_full((*positions.shape[:-1], 2), -1)

    # The positions of t + 1 and t + 2, with -1 past the end.
    next_positions = torch.cat([positions[..., 1:], pads[..., :1]], dim=-1)
    next_next_positions = torch.cat([positions[..., 2:], pads], dim=-1)[..., : positions.size(-1)]

    mask = (next_positions == positions + 1) & (next_next_positions != 0)

    if target_mask is not None:
        mask = mask & torch.cat([target_mask[..., 1:], target_mask.new_zeros(mask[..., :1].shape)], dim=-1)

    return mask


def shift_mtp_targets(targets: Tensor) -> Tensor:
    """Returns the MTP head's target at each position, ``targets[t + 1]``
    (the last position's is a repeat, never counted by
    :func:`mtp_target_mask`)."""
    return torch.cat([targets[..., 1:], targets[..., -1:]], dim=-1)
