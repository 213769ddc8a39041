"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import final

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module, Parameter
from typing_extensions import override

from fairseq2.data_type import DataType
from fairseq2.device import Device
from fairseq2.gang import Gangs, get_current_gangs
from fairseq2.logging import log
from fairseq2.nn import (
    BatchLayout,
    ColumnShardedLinear,
    IncrementalState,
    IncrementalStateBag,
    Linear,
    RowShardedLinear,
)
from fairseq2.nn.sharded import Sharded

from qwen35_fs2.nn.normalization import GatedRMSNorm
from qwen35_fs2.nn.tp import call_with_tp_summed_gradients, check_tp_divisible, init_shard
from qwen35_fs2.ops import GdnBackendRequest, causal_conv1d, gated_delta_rule, resolve_gdn_backend
from qwen35_fs2.ops.varlen import VarlenMetadata


@final
class GatedDeltaNet(Module):
    """The Gated DeltaNet token mixer (Yang et al., 2024) as used by Qwen3.5.

    ::

        x ──in_proj_qkv──conv1d+silu──┬─ q ─ l2norm ─┐
                                      ├─ k ─ l2norm ─┤ gated delta rule ── norm(·, z) ── output_proj
                                      └─ v ──────────┘      ▲   ▲           ▲
        x ──in_proj_b── sigmoid ─────────────────── beta ───┘   │           │
        x ──in_proj_a── -exp(A_log)·softplus(a + dt_bias) ─ g ──┘           │
        x ──in_proj_z───────────────────────────────────────────────────────┘

    Packed batches (``seqs`` of shape :math:`(T,M)`) are split at the
    document starts of their layout: neither the convolution nor the
    recurrent state ever crosses a document boundary. In padded batches the
    pad positions neither decay nor write the state.

    Differences from the Hugging Face module: the rows of ``in_proj_qkv`` and
    the channels of ``conv1d`` are grouped by key head, ``[q_g | k_g | v_g]``
    for key head ``g`` and its ``num_value_heads / num_key_heads`` value heads
    (Hugging Face stores ``[q | k | v]``, each over all heads; the converters
    permute the rows, bit for bit). A contiguous block of rows is then whole
    key-head groups, so tensor parallelism splits every parameter by
    contiguous blocks: each rank holds ``num_key_heads / tp_size`` groups,
    with their ``in_proj_z``/``in_proj_b``/``in_proj_a`` rows, ``A_log`` and
    ``dt_bias`` entries and ``output_proj`` columns. The ``norm`` weight,
    shared by all heads, is replicated and its gradient summed over the ranks.
    """

    def __init__(
        self,
        model_dim: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel_size: int,
        *,
        norm_eps: float = 1e-6,
        backend: GdnBackendRequest = "torch",
        proj_init_fn: Callable[[Linear], None] | None = None,
        gangs: Gangs | None = None,
        device: Device | None = None,
        dtype: DataType | None = None,
    ) -> None:
        super().__init__()

        if num_value_heads % num_key_heads != 0:
            raise ValueError(
                f"`num_value_heads` must be a multiple of `num_key_heads` ({num_key_heads}), but is {num_value_heads} instead."
            )

        if gangs is None:
            gangs = get_current_gangs(device)

        tp_gang = gangs.tp

        check_tp_divisible("num_key_heads", num_key_heads, tp_gang)

        self.num_key_heads = num_key_heads
        self.num_value_heads = num_value_heads
        self.key_head_dim = key_head_dim
        self.value_head_dim = value_head_dim
        self.backend: GdnBackendRequest = backend

        self.tp_gang = tp_gang

        # The heads of this rank.
        self.num_local_key_heads = num_key_heads // tp_gang.size
        self.num_local_value_heads = num_value_heads // tp_gang.size

        key_dim = num_key_heads * key_head_dim
        value_dim = num_value_heads * value_head_dim

        def make_column_linear(output_dim: int) -> ColumnShardedLinear:
            return ColumnShardedLinear(
                model_dim,
                output_dim,
                bias=False,
                gather_output=False,
                init_fn=proj_init_fn,
                gangs=gangs,
                device=device,
                dtype=dtype,
            )

        self.in_proj_qkv = make_column_linear(2 * key_dim + value_dim)
        self.in_proj_z = make_column_linear(value_dim)
        self.in_proj_b = make_column_linear(num_value_heads)
        self.in_proj_a = make_column_linear(num_value_heads)

        self.conv1d = CausalDepthwiseConv1d(
            (2 * key_dim + value_dim) // tp_gang.size,
            conv_kernel_size,
            backend=backend,
            num_shards=tp_gang.size,
            shard_idx=tp_gang.rank,
            device=device,
            dtype=dtype,
        )

        self.decay = GatedDeltaNetDecay(
            self.num_local_value_heads, num_shards=tp_gang.size, shard_idx=tp_gang.rank, device=device, dtype=dtype
        )

        self.norm = GatedRMSNorm(
            value_head_dim, eps=norm_eps, backend=backend, device=device, dtype=dtype
        )

        self.output_proj = RowShardedLinear(
            value_dim,
            model_dim,
            bias=False,
            scatter_input=False,
            init_fn=proj_init_fn,
            gangs=gangs,
            device=device,
            dtype=dtype,
        )

    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout,
        *,
        state_bag: IncrementalStateBag | None = None,
        varlen: VarlenMetadata | None = None,
    ) -> Tensor:
        """
        :param seqs: *Shape:* :math:`(N,S,M)`, or :math:`(T,M)` if packed.
        :param varlen: The documents of a packed batch (the decoder makes
            them once per batch); made from ``seqs_layout`` if ``None``.

        :returns: *Shape:* Same as ``seqs``.
        """
        incremental = not self.training and state_bag is not None

        backend = resolve_gdn_backend(self.backend, seqs.device)

        if seqs_layout.packed:
            if seqs.ndim != 2 or seqs.size(0) != seqs_layout.width:
                raise ValueError(
                    f"`seqs` must be of shape (T={seqs_layout.width}, M) to match its packed layout, but is of shape {tuple(seqs.shape)} instead."
                )

            if varlen is None:
                varlen = VarlenMetadata.from_batch_layout(seqs_layout, seqs.device)

            # (T, M) -> (1, T, M)
            x = seqs.unsqueeze(0)
        else:
            varlen = None

            x = seqs

        state: GatedDeltaNetState | None = None

        if incremental:
            if seqs_layout.packed or seqs_layout.padded:
                raise ValueError(
                    "`seqs` must be neither packed nor padded during incremental decoding."
                )

            assert state_bag is not None

            state = state_bag.maybe_get_state(self, GatedDeltaNetState)

            if state is not None:
                state.check_batch_size(x.size(0))

        # (N, S, M) -> (N, S, G x (2 x K_h + R x V_h)), grouped by key head
        qkv = self.in_proj_qkv(x)

        qkv, conv_state = self.conv1d(
            qkv,
            varlen=varlen,
            initial_state=None if state is None else state.conv_state,
            output_final_state=incremental,
        )

        # (N, S, G, 2 x K_h + R x V_h)
        qkv = qkv.unflatten(-1, (self.num_local_key_heads, -1))

        value_group_dim = self.num_local_value_heads // self.num_local_key_heads * self.value_head_dim

        # (N, S, G, K_h), (N, S, G, K_h), (N, S, G, R x V_h)
        q, k, v = qkv.split([self.key_head_dim, self.key_head_dim, value_group_dim], dim=-1)

        # (N, S, G, R x V_h) -> (N, S, G, R, V_h) -> (N, S, H_v, V_h), a copy
        # for G > 1 (`v` is a strided slice). Written as one `reshape`, the
        # same copy is indexed by inductor with divisions it does not
        # simplify, which it emits as scalar code on CPU (docs/performance.md,
        # "Ninth session").
        v = v.unflatten(-1, (-1, self.value_head_dim)).flatten(2, 3)

        # (N, S, HV)
        beta = self.in_proj_b(x).sigmoid()

        # (N, S, HV), fp32
        g = self.decay(self.in_proj_a(x))

        if seqs_layout.padded and not seqs_layout.packed:
            # Pad positions neither decay nor write the state, so the final
            # state is the one after the last real token.
            # (N, S, 1)
            real = (seqs_layout.position_indices >= 0).unsqueeze(-1)

            beta = beta * real
            g = g * real

        o, recurrent_state = gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            backend=backend,
            initial_state=None if state is None else state.recurrent_state,
            output_final_state=incremental,
            cu_seqlens=varlen,
        )

        # (N, S, V) -> (N, S, HV, D_v)
        z = self.in_proj_z(x).unflatten(-1, (self.num_local_value_heads, self.value_head_dim))

        o = call_with_tp_summed_gradients(self.norm, self.tp_gang, o, z)

        # (N, S, HV, D_v) -> (N, S, M)
        output = self.output_proj(o.flatten(-2, -1))

        if incremental:
            assert state_bag is not None
            assert conv_state is not None and recurrent_state is not None

            state_bag.set_state(self, GatedDeltaNetState(conv_state, recurrent_state))

        if seqs_layout.packed:
            output = output.squeeze(0)

        return output

    @override
    def extra_repr(self) -> str:
        s = (
            f"num_key_heads={self.num_key_heads}, "
            f"num_value_heads={self.num_value_heads}, "
            f"key_head_dim={self.key_head_dim}, "
            f"value_head_dim={self.value_head_dim}, "
            f"backend={self.backend}"
        )

        if self.tp_gang.size > 1:
            s = f"{s}, tp_rank={self.tp_gang.rank}, tp_size={self.tp_gang.size}"

        return s


@final
class GatedDeltaNetDecay(Module, Sharded):
    """Forms the log decay of every token and value head,
    ``g = -exp(A_log) * softplus(a + dt_bias)``, from ``a = in_proj_a(x)``.

    ``A_log`` and ``dt_bias`` are fp32 parameters, and ``g`` is formed in fp32,
    whatever the dtype of the rest of the model, as the released configs ask
    (``mamba_ssm_dtype: float32``): ``g`` is summed over whole chunks, so its
    rounding compounds, and a bf16 ``A_log`` would move each head's decay rate
    by up to 0.4 %. The parameters stay fp32 when the model is built in or
    cast to a lower precision (``.to(torch.bfloat16)``, loading in bf16), and
    the FSDP applier makes this module an FSDP unit of its own whose
    parameters are gathered, and whose gradients are reduced, in fp32 under
    static mixed precision.

    Under tensor parallelism each rank holds the entries of its value heads.
    """

    def __init__(
        self,
        num_value_heads: int,
        *,
        num_shards: int = 1,
        shard_idx: int = 0,
        device: Device | None = None,
        dtype: DataType | None = None,
    ) -> None:
        """
        :param num_value_heads: The value heads of this rank.
        :param num_shards: The tensor-parallel ranks the heads are split over.
        :param shard_idx: This rank's place among them.
        :param dtype: The dtype of the model; the parameters are at least
            fp32 (fp64 models, for gradient checks, keep fp64).
        """
        super().__init__()

        self.num_value_heads = num_value_heads
        self.num_shards = num_shards
        self.shard_idx = shard_idx

        param_dtype = _at_least_fp32(dtype or torch.get_default_dtype())

        self.A_log = Parameter(torch.empty((num_value_heads,), device=device, dtype=param_dtype))

        self.dt_bias = Parameter(torch.empty((num_value_heads,), device=device, dtype=param_dtype))

        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initializes the parameters as the released models were."""
        # A ~ U(0.01, 16): the lower bound keeps log(A) finite and avoids
        # near-zero decay heads.
        init_shard(self.A_log, lambda A_log: A_log.uniform_(0.01, 16.0).log_(), num_shards=self.num_shards, shard_idx=self.shard_idx)  # fmt: skip

        torch.nn.init.ones_(self.dt_bias)

    def forward(self, a: Tensor) -> Tensor:
        """
        :param a: *Shape:* :math:`(*,H_v)`.

        :returns: The log decay, ``<= 0``. *Shape:* Same as ``a``; fp32 (or the
            dtype of the parameters, if wider).
        """
        if self.A_log.dtype not in (torch.float32, torch.float64):
            _warn_low_precision_decay(self.A_log.dtype)

        dtype = _at_least_fp32(self.A_log.dtype)

        A = self.A_log.to(dtype).exp()

        return -A * F.softplus(a.to(dtype) + self.dt_bias.to(dtype))

    @override
    def __setattr__(self, name: str, value: object) -> None:
        # fairseq2's FSDP2 `summon_full_parameters`, in which its trainer
        # validates, gathers every parameter and replaces it by a copy in the
        # mixed-precision dtype (`apply_to_parameters`, not `_apply`): a copy
        # of a parameter rounded to a lower precision keeps the parameter.
        # Anything else is assigned as it is, FSDP's own parameters included.
        if name in ("A_log", "dt_bias") and isinstance(value, Parameter):
            current = self._parameters.get(name)

            if current is not None and _is_rounded_copy(value, current):
                value = current

        super().__setattr__(name, value)

    @override
    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Module:
        # `Module.to()`, `.bfloat16()`, `.half()` and fairseq2's dtype casts
        # all end here: the parameters follow every device move but keep at
        # least fp32.
        def keep_at_least_fp32(t: Tensor) -> Tensor:
            out = fn(t)

            if out.is_floating_point() and out.dtype != _at_least_fp32(out.dtype):
                return t.to(device=out.device, dtype=_at_least_fp32(t.dtype))

            return out

        return super()._apply(keep_at_least_fp32, recurse)

    @override
    def get_shard_dims(self) -> list[tuple[Parameter, int]]:
        return [(self.A_log, 0), (self.dt_bias, 0)]

    @override
    def extra_repr(self) -> str:
        return f"num_value_heads={self.num_value_heads}"


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _is_rounded_copy(value: Tensor, param: Tensor) -> bool:
    """Whether ``value`` is ``param`` rounded to a lower precision."""
    if type(param) is not Parameter or value.is_meta or param.is_meta:
        return False

    if value.shape != param.shape or value.device != param.device:
        return False

    if torch.promote_types(value.dtype, param.dtype) != param.dtype or value.dtype == param.dtype:
        return False

    return torch.equal(param.detach().to(value.dtype), value.detach())


@cache
def _warn_low_precision_decay(dtype: torch.dtype) -> None:
    log.warning(
        "The Gated DeltaNet decay parameters (A_log, dt_bias) arrive in {} in a forward pass, which rounds every head's decay rate. Under FSDP, use a granularity of 'layer' or 'stack', whose applier keeps them in fp32.",
        dtype,
    )


@final
class CausalDepthwiseConv1d(Module, Sharded):
    """A bias-free depthwise causal convolution whose receptive field stops
    at document starts.

    The weight keeps the :class:`torch.nn.Conv1d` shape ``[C, 1, W]`` of the
    released checkpoints. Under tensor parallelism ``C`` is the rank's
    channels (a contiguous block of the unsharded ones).
    """

    def __init__(
        self,
        num_channels: int,
        kernel_size: int,
        *,
        backend: GdnBackendRequest = "torch",
        num_shards: int = 1,
        shard_idx: int = 0,
        device: Device | None = None,
        dtype: DataType | None = None,
    ) -> None:
        """
        :param num_channels: The channels of this rank.
        :param num_shards: The tensor-parallel ranks the channels are split
            over.
        :param shard_idx: This rank's place among them.
        """
        super().__init__()

        self.num_channels = num_channels
        self.kernel_size = kernel_size
        self.backend: GdnBackendRequest = backend
        self.num_shards = num_shards
        self.shard_idx = shard_idx

        self.weight = Parameter(
            torch.empty((num_channels, 1, kernel_size), device=device, dtype=dtype)
        )

        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_shard(self.weight, lambda weight: torch.nn.init.kaiming_uniform_(weight, a=5**0.5), num_shards=self.num_shards, shard_idx=self.shard_idx)  # fmt: skip

    def forward(
        self,
        x: Tensor,
        *,
        varlen: VarlenMetadata | None = None,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """
        :param x: *Shape:* :math:`(N,S,C)`.
        :param varlen: The documents of ``x`` if packed (``N`` is 1).

        :returns: ``silu(conv(x))`` and, if requested, the last ``W - 1``
            inputs of each sequence.
        """
        return causal_conv1d(
            x,
            self.weight.squeeze(1),
            activation="silu",
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=varlen,
            backend=resolve_gdn_backend(self.backend, x.device),
        )

    @override
    def get_shard_dims(self) -> list[tuple[Parameter, int]]:
        return [(self.weight, 0)]

    @override
    def extra_repr(self) -> str:
        return f"num_channels={self.num_channels}, kernel_size={self.kernel_size}, backend={self.backend}"


@final
class GatedDeltaNetState(IncrementalState):
    """Holds what a :class:`GatedDeltaNet` needs to continue a sequence: the
    last ``W - 1`` convolution inputs and the fp32 recurrent state."""

    def __init__(self, conv_state: Tensor, recurrent_state: Tensor) -> None:
        """
        :param conv_state: *Shape:* :math:`(N,C,W-1)`.
        :param recurrent_state: *Shape:* :math:`(N,H_v,K,V)`, fp32.
        """
        if conv_state.size(0) != recurrent_state.size(0):
            raise ValueError(
                f"`conv_state` and `recurrent_state` must have the same batch size, but have {conv_state.size(0)} and {recurrent_state.size(0)} instead."
            )

        self.conv_state = conv_state
        self.recurrent_state = recurrent_state

    def check_batch_size(self, batch_size: int) -> None:
        if self.conv_state.size(0) != batch_size:
            raise ValueError(
                f"The batch size of `seqs` must match the batch size of the incremental state ({self.conv_state.size(0)}), but is {batch_size} instead."
            )

    @override
    def reorder(self, new_order: Tensor) -> None:
        self.conv_state = self.conv_state.index_select(0, new_order)
        self.recurrent_state = self.recurrent_state.index_select(0, new_order)

    @override
    def size_bytes(self) -> int:
        return self.capacity_bytes()

    @override
    def capacity_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.conv_state, self.recurrent_state)
        )
