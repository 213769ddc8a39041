"""How Qwen3.5 models are split under FSDP2 (the families' FSDP applier).

FSDP2 shards every parameter of a unit along its first dimension across the
sharded data-parallel ranks (``gangs.sdp``) and gathers a unit's parameters
only around its forward and backward passes. For Qwen3.5 that means:

- ``layer`` (the default): one unit per decoder layer, Gated DeltaNet and
  full-attention layers alike, and one for the multi-token-prediction head
  if the model has one; the last layer is not resharded after its forward
  pass, as the backward pass starts with it. The root unit holds what is
  left: the embedding, the (possibly tied) output projection and the final
  norm.
- ``stack``: the decoder (all layers and the final norm) is one unit (and
  the multi-token-prediction head another), the root holds the embedding
  and the output projection.
- ``model``: the whole model is one unit, not resharded after its forward
  pass.

At every granularity, the ``A_log`` and ``dt_bias`` of each Gated DeltaNet
layer (its :class:`~qwen35_fs2.nn.gated_deltanet.GatedDeltaNetDecay`) are
a small unit of their own, gathered and reduced in fp32 under mixed precision
(``mamba_ssm_dtype: float32``), and kept gathered between forward and
backward (two vectors of ``H_v`` entries per layer). So is the weight of
every MoE router whose ``precision`` is ``fp32`` (resharded after its
forward pass, as it is ``E x M``). fairseq2's recipes wrap
``model`` granularity themselves, without this applier: the decay parameters
and routers are then cast with the rest, and the layers warn about the
former.

MoE experts are stacked ``(E, 2I, M)`` and ``(E, M, I)`` tensors, so FSDP2's
first-dimension sharding gives each rank whole experts (``E / sdp_size`` of
them, the last ranks fewer if ``E`` is not a multiple). Under tensor
parallelism FSDP2 shards each rank's tensor-parallel shard. Under expert
parallelism the experts of each block are a unit of their own, over another
mesh (:mod:`qwen35_fs2.parallel.expert_parallel`).
"""

from __future__ import annotations

from typing import Final, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn import Module

from fairseq2.data_type import DataType
from fairseq2.gang import Gangs
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.models.utils.fsdp import apply_layerwise_fsdp
from fairseq2.nn.fsdp import FSDPWrapper

from qwen35_fs2.compat.fsdp_unit_precision import fsdp_unit_mixed_precision, keep_fsdp_unit_in_fp32
from qwen35_fs2.nn.moe.expert_parallel import ExpertParallelism
from qwen35_fs2.nn.moe.experts import RoutedExperts
from qwen35_fs2.nn.moe.router import TopKRouter
from qwen35_fs2.nn.mtp import find_mtp
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNetDecay
from qwen35_fs2.parallel.expert_parallel import (
    detached_expert_parallel_experts,
    shard_expert_parallel_experts,
)

QWEN35_FSDP_GRANULARITIES: Final = ("layer", "stack", "model")


def apply_fsdp_to_qwen35(
    model: TransformerLM, granularity: str, wrapper: FSDPWrapper
) -> Module:
    """Wraps the FSDP units of ``model`` at ``granularity`` (see the module
    docstring) with ``wrapper``; the caller wraps the root module last.

    A model that is already sharded (by :func:`shard_qwen35_with_fsdp2`, when
    its checkpoint was loaded straight into the shards) is returned as is,
    so that fairseq2's recipes wrap it no further.
    """
    if isinstance(model, FSDPModule):
        return model

    if granularity not in QWEN35_FSDP_GRANULARITIES:
        raise ValueError(
            f"`granularity` must be one of {', '.join(QWEN35_FSDP_GRANULARITIES)}, but is '{granularity}' instead."
        )

    # Routed experts under expert parallelism are units of their own, over
    # another mesh; fairseq2's wrapper must not see them.
    with detached_expert_parallel_experts(model) as ep_experts:
        sharded = _apply_units(model, granularity, wrapper)

        if ep_experts:
            _shard_expert_parallel_units(model, sharded, ep_experts, granularity)

    return sharded


def _apply_units(model: TransformerLM, granularity: str, wrapper: FSDPWrapper) -> Module:
    # First, inside every unit below: the decay parameters of the Gated
    # DeltaNet layers, gathered and reduced in fp32.
    decays = [m for m in model.modules() if isinstance(m, GatedDeltaNetDecay)]

    for decay in decays:
        keep_fsdp_unit_in_fp32(wrapper(decay, reshard_after_forward=False))

    # The routers that compute in fp32 get their weight in fp32, not
    # rounded to the mixed precision dtype and upcast.
    routers = [m for m in model.modules() if isinstance(m, TopKRouter) and m.precision == "fp32"]

    for router in routers:
        keep_fsdp_unit_in_fp32(wrapper(router))

    if granularity == "model":
        return wrapper(model, reshard_after_forward=False)

    if granularity == "layer":
        apply_layerwise_fsdp(model.decoder.layers, wrapper)
    else:
        model.register_module("decoder", wrapper(model.decoder))

    # A unit of its own: gathered only around its passes, not for the whole
    # step with the root.
    mtp = find_mtp(model)

    if mtp is not None:
        wrapper(mtp)

    return model


def _shard_expert_parallel_units(
    model: TransformerLM,
    sharded: Module,
    ep_experts: list[tuple[RoutedExperts, ExpertParallelism]],
    granularity: str,
) -> None:
    """Shards the (detached) ``ep_experts`` as
    :mod:`qwen35_fs2.parallel.expert_parallel` describes, in the policy of
    the model's other units."""
    unit = model.decoder.layers[0] if granularity == "layer" else model.decoder if granularity == "stack" else sharded

    mp_policy = fsdp_unit_mixed_precision(unit)

    # The model's device, meta before its shards are allocated; its mesh's
    # device type is the gang's.
    param = cast(DTensor, next(unit.parameters()))

    for experts, ep in ep_experts:
        shard_expert_parallel_experts(
            experts, ep, mp_policy=mp_policy, device=param.device, device_type=param.device_mesh.device_type
        )


def shard_qwen35_with_fsdp2(
    model: TransformerLM,
    gangs: Gangs,
    *,
    granularity: str = "layer",
    mixed_precision_dtype: DataType | None = None,
    fp32_reduce: bool = False,
    reshard_after_forward: bool = True,
) -> FSDPModule:
    """Shards ``model`` with FSDP2 as fairseq2's ``to_fsdp2`` does (same
    device mesh over ``gangs.sdp``/``gangs.rdp``, same mixed precision
    policy, units of :func:`apply_fsdp_to_qwen35`), but leaves the parameters
    where they are.

    fairseq2 materializes each unit in full before sharding it; here a model
    on the meta device stays there, so that ``model.to_empty(...)`` then
    allocates only this rank's shards (see
    :mod:`qwen35_fs2.hf.sharded_loading`).
    """
    if gangs.sdp.size == 1:
        raise ValueError(
            "`gangs.sdp.size` must be greater than 1 to shard with FSDP2, but is 1 instead."
        )

    device_type = gangs.dp.device.type

    if gangs.rdp.size > 1:
        mesh = DeviceMesh.from_group(
            [gangs.rdp.as_process_group(), gangs.sdp.as_process_group()],
            device_type,
            torch.arange(gangs.dp.size).view(gangs.rdp.size, gangs.sdp.size),
            mesh_dim_names=("inter", "intra"),
        )
    else:
        mesh = DeviceMesh.from_group(
            gangs.sdp.as_process_group(), device_type, None, mesh_dim_names=("intra",)
        )

    if mixed_precision_dtype is None or mixed_precision_dtype == torch.float32:
        mp_policy = MixedPrecisionPolicy()
    else:
        reduce_dtype = torch.float32 if fp32_reduce else mixed_precision_dtype

        mp_policy = MixedPrecisionPolicy(mixed_precision_dtype, reduce_dtype)

    default_reshard_after_forward = reshard_after_forward

    def wrap(module: Module, reshard_after_forward: bool | None = None) -> Module:
        if reshard_after_forward is None:
            reshard_after_forward = default_reshard_after_forward

        # `fully_shard` turns `module` into an `FSDPModule` in place.
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)

        return module

    sharded = apply_fsdp_to_qwen35(model, granularity, wrap)

    if not isinstance(sharded, FSDPModule):
        sharded = wrap(sharded, reshard_after_forward=False)

    return cast(FSDPModule, sharded)
