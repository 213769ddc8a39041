"""Partial rotary position encoding of the Qwen3.5 attention layers."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor
from typing_extensions import override

from fairseq2.nn import BatchLayout, IncrementalStateBag, PositionEncoder


@final
class PartialRotaryEncoder(PositionEncoder):
    """Rotates the first ``rotary_dim`` dimensions of each head with NeoX-style
    ``rotate_half`` and leaves the others unchanged.

    For text, Qwen3.5's interleaved mRoPE reduces to this: its temporal,
    height and width positions are all the token position. The angles are
    computed per call from the positions rather than read from a table, so
    the 262k-token context costs no memory.
    """

    def __init__(
        self,
        encoding_dim: int,
        rotary_dim: int,
        *,
        theta: float,
    ) -> None:
        """
        :param encoding_dim: The dimensionality of each head.
        :param rotary_dim: The number of leading dimensions to rotate.
        :param theta: The base of the rotation frequencies.
        """
        super().__init__(encoding_dim)

        if rotary_dim % 2 != 0 or not 0 < rotary_dim <= encoding_dim:
            raise ValueError(
                f"`rotary_dim` must be an even number in (0, {encoding_dim}], but is {rotary_dim} instead."
            )

        self.rotary_dim = rotary_dim
        self.theta = theta

    @override
    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout,
        *,
        state_bag: IncrementalStateBag | None = None,
    ) -> Tensor:
        """
        :param seqs: *Shape:* :math:`(N,S,H,E)`, or :math:`(S,H,E)` if packed.
        """
        if seqs_layout.packed or seqs_layout.padded:
            # Pad positions are -1; their value does not matter.
            positions = seqs_layout.position_indices.clamp(min=0)
        else:
            positions = torch.arange(seqs_layout.width, device=seqs.device)

        if not self.training and state_bag is not None:
            positions = positions + state_bag.step_nr

        # In fp32 at every call rather than kept in a buffer, which
        # `Module.to(torch.bfloat16)` would round: frequencies off by up to
        # 0.3 % turn tokens 1,000 apart by a radian more or less than the
        # model was trained with.
        exponents = torch.arange(0, self.rotary_dim, 2, device=seqs.device, dtype=torch.float32)

        inv_freq = 1.0 / (self.theta ** (exponents / self.rotary_dim))

        # ([N], S) -> ([N], S, R / 2)
        freqs = positions.unsqueeze(-1).float() * inv_freq

        # ([N], S, R / 2) -> ([N], S, 1, R)
        freqs = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)

        fp32_rot = seqs[..., : self.rotary_dim].float()

        half = self.rotary_dim // 2

        rotated_half = torch.cat((-fp32_rot[..., half:], fp32_rot[..., :half]), dim=-1)

        fp32_rot = fp32_rot * freqs.cos() + rotated_half * freqs.sin()

        rot = fp32_rot.type_as(seqs)

        if self.rotary_dim == self.encoding_dim:
            return rot

        return torch.cat((rot, seqs[..., self.rotary_dim :]), dim=-1)

    @override
    def extra_repr(self) -> str:
        return (
            f"encoding_dim={self.encoding_dim}, "
            f"rotary_dim={self.rotary_dim}, "
            f"theta={self.theta}"
        )
