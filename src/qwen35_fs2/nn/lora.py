"""Low-rank adapters (LoRA) on fairseq2 projections."""

from __future__ import annotations

import math
from functools import partial
from typing import Literal, TypeAlias, final

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import Dropout, Module, ModuleDict, Parameter
from torch.nn.functional import linear
from typing_extensions import override

from fairseq2.error import NotSupportedError
from fairseq2.gang import Gang
from fairseq2.nn import ColumnShardedLinear, Linear, Projection, RowShardedLinear
from fairseq2.nn.sharded import Sharded
from fairseq2.ops.tensor_parallel import gather, reduce, reduce_on_backward

from qwen35_fs2.nn.moe.experts import RoutedExperts
from qwen35_fs2.nn.tp import check_tp_divisible, init_shard, sum_gradient_over_tp

LoraTpSplit: TypeAlias = Literal["output", "input"]
"""How the adapter of a tensor-parallel projection is split over the ranks:
``"output"`` (a column-sharded projection) splits the rows of ``B``,
``"input"`` (a row-sharded one) the columns of ``A``."""


@final
class LoraAdapter(Module, Sharded):
    """The low-rank update ``scaling · B(A(dropout(x)))`` of a projection.

    ``A`` (``r × input_dim``) starts Kaiming-uniform and ``B``
    (``output_dim × r``) at zero, as PEFT initialises them, so a new adapter
    leaves the projection's output unchanged.

    Under tensor parallelism the adapter is split as its projection is, so
    that each rank's update is its share of the projection's output:

    - ``tp_split="output"`` (column-sharded projection, whose rank computes
      its rows of the output): each rank holds its rows of ``B`` and all of
      ``A``. Every rank's rows depend on ``A x``, so the gradient of ``A x``
      is summed over the ranks in the backward pass: an all-reduce of ``r``
      values per token, which gives every rank the whole gradient of ``A``
      and of ``x``.
    - ``tp_split="input"`` (row-sharded projection, whose ranks' partial
      outputs are summed): each rank holds its columns of ``A`` and all of
      ``B``. The ranks' partial ``A x`` are summed in the forward pass (``r``
      values per token), so ``B`` sees, and its gradient is, that of the
      unsharded adapter.

    A replicated input's dropout mask would then have to be the same on
    every rank; fairseq2's trainer seeds every rank apart, so the recipes
    refuse adapter dropout under tensor parallelism
    (:func:`~qwen35_fs2.lora.config.validate_lora_tensor_parallelism`).
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
        tp_split: LoraTpSplit | None = None,
        tp_gang: Gang | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """
        :param input_dim: The input dimension of the unsharded projection.
        :param output_dim: The output dimension of the unsharded projection.
        :param rank: ``r``, the inner dimension of the update.
        :param alpha: The numerator of the scaling.
        :param dropout_p: The dropout probability on the adapter's input.
        :param rslora: If ``True``, scales by ``alpha / sqrt(r)`` (rank-stabilised
            LoRA) instead of ``alpha / r``.
        :param tp_split: How the adapter is split over the ranks of
            ``tp_gang``; ``None`` if the projection is not tensor-parallel.
        :param tp_gang: The tensor-parallel gang of the projection; required
            with ``tp_split``.
        """
        super().__init__()

        if rank <= 0:
            raise ValueError(f"`rank` must be greater than 0, but is {rank} instead.")

        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"`dropout_p` must be in [0, 1), but is {dropout_p} instead.")

        if (tp_split is None) != (tp_gang is None):
            raise ValueError(
                f"`tp_gang` must be given if and only if `tp_split` is, but `tp_split` is {tp_split!r} and `tp_gang` is {tp_gang!r} instead."
            )

        # The rank's shard of A's columns and its rows of B.
        a_num_shards, a_shard_idx = 1, 0

        b_output_dim = output_dim

        if tp_gang is not None:
            if tp_split == "input":
                check_tp_divisible("input_dim", input_dim, tp_gang)

                a_num_shards, a_shard_idx = tp_gang.size, tp_gang.rank
            else:
                check_tp_divisible("output_dim", output_dim, tp_gang)

                b_output_dim = output_dim // tp_gang.size

        self.rank = rank

        self.scaling = alpha / math.sqrt(rank) if rslora else alpha / rank

        self.dropout = Dropout(dropout_p) if dropout_p > 0.0 else None

        self.tp_split = tp_split

        self.tp_gang = tp_gang

        self.a_proj = Linear(
            input_dim // a_num_shards,
            rank,
            bias=False,
            init_fn=partial(_init_a, num_shards=a_num_shards, shard_idx=a_shard_idx),
            device=device,
            dtype=dtype,
        )

        self.b_proj = Linear(rank, b_output_dim, bias=False, init_fn=_init_b, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        self.a_proj.reset_parameters()
        self.b_proj.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        """
        :param x: The input of the projection on this rank.

        :returns: The update of the projection's output on this rank.
        """
        if self.dropout is not None:
            x = self.dropout(x)

        h = self.a_proj(x)

        if self.tp_gang is not None and self.tp_gang.size > 1:
            if self.tp_split == "output":
                h = reduce_on_backward(h, self.tp_gang)
            else:
                h = reduce(h, self.tp_gang)

        return self.b_proj(h) * self.scaling

    def add_to_output(self, proj: Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        """The forward hook of the adapted projection ``proj``: returns its
        ``output`` plus the update of its input ``args[0]``.

        As in PEFT, the update is computed in the adapter's dtype and added in
        the output's.
        """
        x = args[0]

        return output + self(x.to(self.a_proj.weight.dtype)).to(output.dtype)

    def update_rows(self, x: Tensor, start: int, length: int) -> Tensor:
        """Returns rows ``start`` to ``start + length`` of the update of the
        unsharded projection, from ``B`` gathered over the ranks: the update
        of a column-sharded projection whose weight is gathered the same way
        (replicated key/value heads, :class:`~qwen35_fs2.nn.Qwen35Attention`).

        Each rank's rows are its own, so the gradients of ``A`` and of the
        gathered ``B`` are summed over the ranks; the caller sums the
        gradient of ``x``.
        """
        if self.tp_split != "output" or self.tp_gang is None:
            raise ValueError(f"The adapter must be split by output rows (`tp_split='output'`), but `tp_split` is {self.tp_split!r} instead.")

        x = x.to(self.a_proj.weight.dtype)

        if self.dropout is not None:
            x = self.dropout(x)

        a = sum_gradient_over_tp(self.a_proj.weight, self.tp_gang)

        b = sum_gradient_over_tp(gather(self.b_proj.weight, self.tp_gang, dim=0), self.tp_gang)

        return linear(linear(x, a), b.narrow(0, start, length)) * self.scaling

    @override
    def get_shard_dims(self) -> list[tuple[Parameter, int]]:
        if self.tp_split == "output":
            return [(self.b_proj.weight, 0)]

        if self.tp_split == "input":
            return [(self.a_proj.weight, 1)]

        return []

    def extra_repr(self) -> str:
        """:meta private:"""
        s = f"rank={self.rank}, scaling={self.scaling}"

        if self.tp_gang is not None:
            s = f"{s}, tp_split={self.tp_split}, tp_rank={self.tp_gang.rank}, tp_size={self.tp_gang.size}"

        return s


def _init_a(proj: Linear, *, num_shards: int, shard_idx: int) -> None:
    # U(-1/sqrt(input_dim), 1/sqrt(input_dim)), PEFT's default for A; a split
    # A is this shard's columns of the unsharded one.
    init_shard(
        proj.weight,
        lambda weight: torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5)),
        num_shards=num_shards,
        shard_idx=shard_idx,
        dim=1,
    )


def _init_b(proj: Linear) -> None:
    torch.nn.init.zeros_(proj.weight)


@final
class ExpertLoraAdapter(Module):
    """The low-rank updates ``scaling · B_e A_e`` of a stacked expert weight
    ``W`` :math:`(E, O, I)`, one per expert, as PEFT's ``target_parameters``
    puts them on the fused experts of transformers.

    ``A`` :math:`(E, r, I)` starts uniform in ``±1/sqrt(I)`` and ``B``
    :math:`(E, O, r)` at zero, PEFT's initialisation, so a new adapter leaves
    the experts' output unchanged.

    The adapter updates the weight, not the output (:meth:`forward` returns
    ``W + scaling · B A``): the experts then run on adapted weights through
    any of their dispatch paths, as transformers' experts run under PEFT.
    That costs one extra weight-sized tensor per projection and forward
    pass; an update computed per group of routed tokens would not, but would
    need each dispatch path to compute it. For the same reason there is no
    dropout on the input (PEFT refuses it too).
    """

    def __init__(
        self,
        num_experts: int,
        input_dim: int,
        output_dim: int,
        *,
        rank: int,
        alpha: float,
        rslora: bool,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()

        if rank <= 0:
            raise ValueError(f"`rank` must be greater than 0, but is {rank} instead.")

        self.rank = rank

        self.scaling = alpha / math.sqrt(rank) if rslora else alpha / rank

        self.a = Parameter(torch.empty((num_experts, rank, input_dim), device=device, dtype=dtype))
        self.b = Parameter(torch.empty((num_experts, output_dim, rank), device=device, dtype=dtype))

        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_expert_a(self.a)

        torch.nn.init.zeros_(self.b)

    def forward(self, weight: Tensor) -> Tensor:
        """Returns ``weight`` plus the update, in the adapter's dtype."""
        return torch.baddbmm(weight.to(self.a.dtype), self.b, self.a, alpha=self.scaling)

    def extra_repr(self) -> str:
        """:meta private:"""
        return f"rank={self.rank}, scaling={self.scaling}"


def _init_expert_a(a: Tensor) -> None:
    # U(-1/sqrt(I), 1/sqrt(I)), PEFT's default for A.
    bound = 1.0 / math.sqrt(a.size(-1))

    torch.nn.init.uniform_(a, -bound, bound)


def add_expert_lora_adapter(
    experts: RoutedExperts,
    weight_name: Literal["gate_inner_proj", "output_proj"],
    *,
    rank: int,
    alpha: float,
    rslora: bool,
) -> ExpertLoraAdapter:
    """Adds an :class:`ExpertLoraAdapter` on the stacked weight
    ``weight_name`` of ``experts``, as ``experts.lora[weight_name]``: its
    parameters are new keys ending in ``.lora.{weight_name}.a`` and ``.b``,
    created in the dtype and on the device of the weight.

    :raises NotSupportedError: if ``experts`` is split over tensor-parallel
        ranks.
    """
    if experts.num_local_experts != experts.num_experts:
        raise NotSupportedError(
            f"LoRA adapters on routed experts need the experts unsharded (a tensor parallel size of 1), but `experts` holds {experts.num_local_experts} of {experts.num_experts} experts instead. "
            "Put adapters on the shared expert and the mixers only (`target_parameters: []`), or train with a tensor parallel size of 1."
        )

    if experts.lora is None:
        experts.lora = ModuleDict()

    if weight_name in experts.lora:
        raise ValueError(f"`experts.{weight_name}` must not have a LoRA adapter yet, but has one instead.")

    weight = getattr(experts, weight_name)

    num_experts, output_dim, input_dim = weight.shape

    adapter = ExpertLoraAdapter(
        num_experts, input_dim, output_dim, rank=rank, alpha=alpha, rslora=rslora, device=weight.device, dtype=weight.dtype
    )

    experts.lora[weight_name] = adapter

    return adapter


def is_lora_module(module: Module) -> bool:
    """Whether ``module`` is a LoRA adapter: of a projection or of a stacked
    expert weight."""
    return isinstance(module, (LoraAdapter, ExpertLoraAdapter))


def reset_lora_adapters(model: Module) -> None:
    """Initializes the adapters of ``model`` as new ones (``A``
    Kaiming-uniform, ``B`` zero), also where FSDP2 shards them.

    Sharded loading allocates them uninitialized, since a base checkpoint has
    none. A sharded ``A`` is drawn whole and scattered from rank 0: drawing
    each rank's rows with the same seed on every rank would repeat the same
    rows in every shard, an adapter of lower rank. Under tensor parallelism
    "whole" is the rank's tensor-parallel shard, itself cut from an ``A``
    drawn whole (:class:`LoraAdapter`). The adapters of routed experts
    (:class:`ExpertLoraAdapter`) are drawn whole likewise, so FSDP2 ranks
    get the shards of the unsharded adapters drawn from the same seed; they
    are in the FSDP unit of their experts, gathered with the weights that
    they update.
    """
    with torch.no_grad():
        for adapter in model.modules():
            if isinstance(adapter, ExpertLoraAdapter):
                if not isinstance(adapter.a, DTensor):
                    adapter.reset_parameters()

                    continue

                a = torch.empty(adapter.a.shape, device=adapter.a.to_local().device, dtype=adapter.a.dtype)

                _init_expert_a(a)

                _copy_shard(a, adapter.a)

                torch.nn.init.zeros_(adapter.b.to_local())

                continue

            if not isinstance(adapter, LoraAdapter):
                continue

            for proj in (adapter.a_proj, adapter.b_proj):
                weight = proj.weight

                if not isinstance(weight, DTensor):
                    proj.reset_parameters()

                    continue

                full = Linear(weight.size(1), weight.size(0), bias=False, init_fn=proj.init_fn, device=weight.to_local().device, dtype=weight.dtype)

                _copy_shard(full.weight.detach(), weight)


def _copy_shard(full: Tensor, param: DTensor) -> None:
    """Copies into ``param`` its shard of ``full``, scattered from rank 0."""
    param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())


def check_lora_adapters_unsharded(model: Module) -> None:
    """Raises a :class:`ValueError` if an adapter of ``model`` is split over
    the ranks of a tensor-parallel gang: its tensors are then this rank's
    shards, not the adapter that an export writes or a merge adds.

    A LoRA checkpoint saved under tensor parallelism is read unsharded by
    loading it onto a model of a tensor parallel size of 1
    (:func:`~qwen35_fs2.lora.sharded.read_lora_checkpoint`).
    """
    for name, module in model.named_modules():
        if isinstance(module, LoraAdapter) and module.tp_gang is not None and module.tp_gang.size > 1:
            raise ValueError(
                f"The LoRA adapters of `model` must be unsharded (a tensor parallel size of 1), but `{name}` is split over {module.tp_gang.size} ranks instead. "
                "Load the checkpoint onto a model of a tensor parallel size of 1 first."
            )


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

    The adapter of a tensor-parallel projection (:class:`ColumnShardedLinear`,
    :class:`RowShardedLinear`) is split as the projection is (see
    :class:`LoraAdapter`); its ``B`` rows follow the projection's weight
    rows, in our order (the Gated DeltaNet ``in_proj_qkv`` rows grouped by
    key head), so the shards of all ranks, concatenated, are the adapter of
    the unsharded projection. A column-sharded projection must keep its
    output sharded, and a row-sharded one must take a sharded input and sum
    the ranks' outputs, as those of the Qwen3.5 layers do.
    """
    if isinstance(getattr(proj, "lora", None), LoraAdapter):
        raise ValueError("`proj` must not have a LoRA adapter yet, but has one instead.")

    tp_split: LoraTpSplit | None = None

    tp_gang: Gang | None = None

    if isinstance(proj, ColumnShardedLinear):
        if proj.sharded and proj.gather_output:
            raise NotSupportedError(
                f"`proj` must keep its output sharded to take a LoRA adapter, but gathers it over {proj.tp_gang.size} ranks instead."
            )

        tp_split, tp_gang = "output", proj.tp_gang
    elif isinstance(proj, RowShardedLinear):
        if proj.sharded and (proj.scatter_input or not proj.reduce_output):
            raise NotSupportedError(
                f"`proj` must take a sharded input and sum the ranks' outputs to take a LoRA adapter, but has `scatter_input={proj.scatter_input}` and `reduce_output={proj.reduce_output}` instead."
            )

        tp_split, tp_gang = "input", proj.tp_gang

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
        tp_split=tp_split,
        tp_gang=tp_gang,
        device=weight.device,
        dtype=weight.dtype,
    )

    proj.lora = adapter

    proj.register_forward_hook(adapter.add_to_output)

    return adapter
