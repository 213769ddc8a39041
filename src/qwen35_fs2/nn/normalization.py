"""The two RMS normalizations of Qwen3.5."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor
from torch.nn import Module, Parameter
from typing_extensions import override

from fairseq2.data_type import DataType
from fairseq2.device import Device
from fairseq2.nn import LayerNorm

from qwen35_fs2.ops import GdnBackendRequest, gated_rms_norm, resolve_gdn_backend


@final
class ZeroCenteredRMSNorm(LayerNorm):
    """Computes ``x / rms(x) * (1 + weight)`` in fp32.

    The weight is stored zero-centred, as in the released checkpoints and in
    the trainers that produced them: checkpoints round-trip bit for bit, the
    norm matches transformers in every dtype (``1 + weight`` is formed in
    fp32), and weight decay pulls the gain toward 1 rather than 0.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        device: Device | None = None,
        dtype: DataType | None = None,
    ) -> None:
        super().__init__()

        self.dim = dim
        self.eps = eps

        self.weight = Parameter(torch.empty((dim,), device=device, dtype=dtype))

        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.zeros_(self.weight)

    @override
    def forward(self, x: Tensor) -> Tensor:
        fp32_x = x.float()

        fp32_x = fp32_x * torch.rsqrt(fp32_x.pow(2).mean(-1, keepdim=True) + self.eps)

        fp32_x = fp32_x * (1.0 + self.weight.float())

        return fp32_x.type_as(x)

    @override
    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"


@final
class GatedRMSNorm(Module):
    """Normalizes each Gated DeltaNet value head, then gates it with
    ``silu(gate)``.

    Unlike :class:`ZeroCenteredRMSNorm`, the weight is a plain gain
    (initialized to 1), shared by all heads.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        backend: GdnBackendRequest = "torch",
        device: Device | None = None,
        dtype: DataType | None = None,
    ) -> None:
        super().__init__()

        self.dim = dim
        self.eps = eps
        self.backend: GdnBackendRequest = backend

        self.weight = Parameter(torch.empty((dim,), device=device, dtype=dtype))

        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        """
        :param x: The input. *Shape:* :math:`(*,D)`.
        :param gate: The gate. *Shape:* Same as ``x``.
        """
        backend = resolve_gdn_backend(self.backend, x.device)

        return gated_rms_norm(x, gate, self.weight, self.eps, backend=backend)

    @override
    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}, backend={self.backend}"
