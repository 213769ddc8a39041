"""Low-rank adapters (LoRA) on fairseq2 projections."""

from __future__ import annotations

import math
from typing import final

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import Dropout, Module

from fairseq2.error import NotSupportedError
from fairseq2.nn import ColumnShardedLinear, Linear, Projection, RowShardedLinear


@final
class LoraAdapter(Module):
    """The low-rank update ``scaling · B(A(dropout(x)))`` of a projection.

    ``A`` (``r × input_dim``) starts Kaiming-uniform and ``B``
    (``output_dim × r``) at zero, as PEFT initialises them, so a new adapter
    leaves the projection's output unchanged.
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        *,
        rank: int,
        alpha: float,
        dropout_p: float,
        rslora: bool,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """
        :param rank: ``r``, the inner dimension of the update.
        :param alpha: The numerator of the scaling.
        :param dropout_p: The dropout probability on the adapter's input.
        :param rslora: If ``True``, scales by ``alpha / sqrt(r)`` (rank-stabilised
            LoRA) instead of ``alpha / r``.
        """
        super().__init__()

        if rank <= 0:
            raise ValueError(f"`rank` must be greater than 0, but is {rank} instead.")

        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"`dropout_p` must be in [0, 1), but is {dropout_p} instead.")

        self.rank = rank

        self.scaling = alpha / math.sqrt(rank) if rslora else alpha / rank

        self.dropout = Dropout(dropout_p) if dropout_p > 0.0 else None

        self.a_proj = Linear(input_dim, rank, bias=False, init_fn=_init_a, device=device, dtype=dtype)

        self.b_proj = Linear(rank, output_dim, bias=False, init_fn=_init_b, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        self.a_proj.reset_parameters()
        self.b_proj.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        if self.dropout is not None:
            x = self.dropout(x)

        return self.b_proj(self.a_proj(x)) * self.scaling

    def add_to_output(self, proj: Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        """The forward hook of the adapted projection ``proj``: returns its
        ``output`` plus the update of its input ``args[0]``.

        As in PEFT, the update is computed in the adapter's dtype and added in
        the output's.
        """
        x = args[0]

        return output + self(x.to(self.a_proj.weight.dtype)).to(output.dtype)

    def extra_repr(self) -> str:
        """:meta private:"""
        return f"rank={self.rank}, scaling={self.scaling}"


def _init_a(proj: Linear) -> None:
    # U(-1/sqrt(input_dim), 1/sqrt(input_dim)), PEFT's default for A.
    torch.nn.init.kaiming_uniform_(proj.weight, a=math.sqrt(5))


def _init_b(proj: Linear) -> None:
    torch.nn.init.zeros_(proj.weight)


def reset_lora_adapters(model: Module) -> None:
    """Initializes the adapters of ``model`` as new ones (``A``
    Kaiming-uniform, ``B`` zero), also where FSDP2 shards them.

    Sharded loading allocates them uninitialized, since a base checkpoint has
    none. A sharded ``A`` is drawn whole and scattered from rank 0: drawing
    each rank's rows with the same seed on every rank would repeat the same
    rows in every shard, an adapter of lower rank.
    """
    with torch.no_grad():
        for adapter in model.modules():
            if not isinstance(adapter, LoraAdapter):
                continue

            for proj, init_fn in ((adapter.a_proj, _init_a), (adapter.b_proj, _init_b)):
                weight = proj.weight

                if not isinstance(weight, DTensor):
                    init_fn(proj)

                    continue

                full = Linear(weight.size(1), weight.size(0), bias=False, init_fn=init_fn, device=weight.to_local().device, dtype=weight.dtype)

                sharded = distribute_tensor(full.weight.detach(), weight.device_mesh, weight.placements)

                weight.to_local().copy_(sharded.to_local())


def is_lora_key(key: str) -> bool:
    """Whether ``key`` of a model's state dict names a tensor of a LoRA
    adapter: adapters are the ``lora`` children of their projections
    (:func:`add_lora_adapter`), and no other module of a Qwen3.5 model has
    that name."""
    return key.startswith("lora.") or ".lora." in key


def add_lora_adapter(
    proj: Projection,
    *,
    rank: int,
    alpha: float,
    dropout_p: float,
    rslora: bool,
) -> LoraAdapter:
    """Adds a :class:`LoraAdapter` to ``proj`` as its child ``lora`` and adds
    its output to ``proj``'s through a forward hook.

    The projection stays where it is, with its parameters under their names,
    so base checkpoints, the Hugging Face key maps, the checkpoint sharders
    and the FSDP units see the same model with or without adapters; the
    adapter's parameters are new keys ending in ``.lora.a_proj.weight`` and
    ``.lora.b_proj.weight``. The adapter is created in the dtype and on the
    device of ``proj``'s weight.

    Tensor-parallel projections are not supported yet: the adapter of a
    column-sharded projection needs its input gradient summed over the
    ranks, and that of a row-sharded one its output.
    """
    if isinstance(getattr(proj, "lora", None), LoraAdapter):
        raise ValueError("`proj` must not have a LoRA adapter yet, but has one instead.")

    if isinstance(proj, (ColumnShardedLinear, RowShardedLinear)) and proj.tp_gang.size > 1:
        raise NotSupportedError(
            f"LoRA on tensor-parallel projections is not supported yet, but `proj` is sharded over {proj.tp_gang.size} ranks. "
            "Train LoRA with data parallelism (FSDP) and a tensor parallel size of 1."
        )

    weight = proj.weight

    if not isinstance(weight, Tensor) or weight.ndim != 2:
        raise ValueError(f"`proj` must have a 2-D `weight`, but is of type `{type(proj).__name__}` instead.")

    adapter = LoraAdapter(
        proj.input_dim,
        proj.output_dim,
        rank=rank,
        alpha=alpha,
        dropout_p=dropout_p,
        rslora=rslora,
        device=weight.device,
        dtype=weight.dtype,
    )

    proj.lora = adapter

    proj.register_forward_hook(adapter.add_to_output)

    return adapter
