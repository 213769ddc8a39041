"""Expert parallelism for Qwen3.5-MoE models under FSDP2: the groups, the
split of each MoE block's routed experts and their FSDP2 units (gradients
are clipped across both kinds of units by
:mod:`qwen35_fs2.parallel.grad_norm`).

With ``ep`` ranks per expert-parallel (EP) group (see
:mod:`qwen35_fs2.nn.moe.expert_parallel` for the token exchange):

- the EP groups are ``ep`` consecutive data-parallel ranks of one
  tensor-parallel rank (so one node holds a group for ``ep`` up to the GPUs
  of a node), and the *replica* groups the ``R = D / ep`` data-parallel ranks
  that share an EP rank;
- :func:`apply_expert_parallelism` keeps the rank's ``E_l / ep`` experts of
  every MoE block (``E_l`` experts per tensor-parallel rank) and attaches
  the exchange to the block;
- under FSDP2 (:func:`~qwen35_fs2.parallel.fsdp.apply_fsdp_to_qwen35`) the
  experts of a block are a unit of their own, sharded over the rank's
  replica group: each rank stores ``E_l / D`` experts, exactly those it
  stores without expert parallelism, and gathers ``E_l / ep`` of them, not
  ``E_l``. Their gradients, which sum the losses of the EP group's ranks,
  are summed over the replicas and divided by ``D``: the mean over the
  data-parallel ranks, as for every other parameter. Everything else is
  sharded over all ``D`` ranks as before.

Checkpoints hold each rank's local shards (fairseq2's FSDP2 state dicts), so
the same rank writes the same file at every EP size, and a run resumes at
another one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast, final

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from fairseq2.error import NotSupportedError
from fairseq2.gang import Gang, Gangs

from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.nn.moe.experts import RoutedExperts
from qwen35_fs2.nn.moe.expert_parallel import (
    ExpertParallelism,
    check_expert_parallel_sizes,
    expert_parallel_order,
)


@final
@dataclass(frozen=True)
class ExpertParallelGroups:
    """The process groups of expert parallelism of one rank."""

    ep: ProcessGroup
    """The ``ep`` consecutive data-parallel ranks that exchange tokens."""

    replicas: ProcessGroup
    """The ``D / ep`` data-parallel ranks that run the same experts."""

    dp: Gang
    """The data-parallel gang, of ``D`` ranks."""

    @property
    def ep_size(self) -> int:
        return dist.get_world_size(self.ep)


def create_expert_parallel_groups(gangs: Gangs, ep_size: int) -> ExpertParallelGroups:
    """Creates the EP and replica groups of ``ep_size`` ranks out of the
    data-parallel gangs of ``gangs``; every rank of ``gangs.root`` must call
    it (each creates every group, as ``torch.distributed.new_group`` asks).

    :raises ValueError: if ``ep_size`` does not divide the data-parallel
        size, or the data-parallel gang is split into hybrid shards.
    """
    dp_size, tp_size = gangs.dp.size, gangs.tp.size

    if ep_size < 1 or dp_size % ep_size != 0:
        raise ValueError(
            f"The expert parallel size must be a positive divisor of the data parallel size ({dp_size}), but is {ep_size} instead."
        )

    if gangs.rdp.size > 1:
        raise NotSupportedError(
            f"Expert parallelism needs FSDP over all {dp_size} data-parallel ranks, but `trainer.fsdp.hybrid` splits them into {gangs.rdp.size} replicas."
        )

    if gangs.pp.size > 1:
        raise NotSupportedError("Expert parallelism does not support pipeline parallelism.")

    # fairseq2's layout: root rank = dp_rank * tp_size + tp_rank.
    def root_rank(dp_rank: int, tp_rank: int) -> int:
        return dp_rank * tp_size + tp_rank

    num_replicas = dp_size // ep_size

    my_dp_rank, my_tp_rank = gangs.dp.rank, gangs.tp.rank

    ep_group = replica_group = None

    for tp_rank in range(tp_size):
        for first in range(0, dp_size, ep_size):
            ranks = [root_rank(d, tp_rank) for d in range(first, first + ep_size)]

            group = dist.new_group(ranks)

            if tp_rank == my_tp_rank and first <= my_dp_rank < first + ep_size:
                ep_group = group

        for ep_rank in range(ep_size):
            ranks = [root_rank(g * ep_size + ep_rank, tp_rank) for g in range(num_replicas)]

            group = dist.new_group(ranks)

            if tp_rank == my_tp_rank and my_dp_rank % ep_size == ep_rank:
                replica_group = group

    if ep_group is None or replica_group is None:
        raise RuntimeError("Every rank must belong to an expert-parallel and a replica group, but this one does not.")

    return ExpertParallelGroups(ep=ep_group, replicas=replica_group, dp=gangs.dp)


def apply_expert_parallelism(model: Module, groups: ExpertParallelGroups) -> None:
    """Keeps this rank's experts of every MoE block of ``model`` and makes the
    blocks exchange tokens over ``groups.ep``; every data-parallel rank must
    call it, before the model is sharded.

    A model whose parameters are on the meta device on some ranks and real on
    data-parallel rank 0 (a new model that fairseq2 broadcasts from rank 0
    when it shards it) gets rank 0's experts: rank 0 broadcasts each block's
    experts before they are split, and the other ranks keep theirs aside
    (:attr:`ExpertParallelism.received_weights`) until they shard them, as
    fairseq2 wants the model on one device until then. A model on the meta
    device everywhere (to be loaded from a checkpoint) stays there.

    :raises ValueError: if the experts of a block cannot be split evenly.
    :raises NotSupportedError: if routed experts carry LoRA adapters.
    """
    blocks = [m for m in model.modules() if isinstance(m, Qwen35MoeBlock)]

    dp = groups.dp

    on_meta = _gather_flags(dp, any(p.is_meta for b in blocks for p in b.experts.parameters()))

    # Rank 0 holds the model; the others receive its experts.
    from_rank_0 = any(on_meta) and not on_meta[0]

    if on_meta[0] and not all(on_meta):
        raise ValueError(
            "The experts must be on the meta device on every rank, on none, or on all but data-parallel rank 0, but are on it on rank 0 and not on others."
        )

    for block in blocks:
        experts = block.experts

        if block.expert_parallel is not None:
            raise ValueError("`model` must not be expert-parallel already, but it is.")

        if experts.lora is not None:
            raise NotSupportedError(
                "Expert parallelism does not support LoRA adapters on the routed experts (`target_parameters`)."
            )

        check_expert_parallel_sizes(experts.num_local_experts, groups.ep_size, dp.size)

        order = expert_parallel_order(experts.num_local_experts, groups.ep_size, dp.size)

        ep = ExpertParallelism(groups.ep, order, replicas=groups.replicas)

        rows = torch.tensor(ep.rank_experts)

        received = {}

        for name in ("gate_inner_proj", "output_proj"):
            param: Parameter = getattr(experts, name)

            data = param.detach()

            if from_rank_0:
                full = data if dp.rank == 0 else torch.empty_like(param, device=dp.device)

                dp.broadcast(full, source_rank=0)

                # fairseq2's wrapper wants the model on one device: the meta
                # ranks keep their rows aside.
                if dp.rank != 0:
                    received[name] = full.index_select(0, rows.to(full.device))

            setattr(experts, name, Parameter(data.index_select(0, rows.to(data.device)), requires_grad=param.requires_grad))

        experts.expert_ids = tuple(experts.expert_ids[row] for row in ep.rank_experts)

        ep.received_weights = received or None

        block.expert_parallel = ep


def _gather_flags(gang: Gang, flag: bool) -> list[bool]:
    """Returns ``flag`` of every rank of ``gang``, in rank order."""
    flags = torch.zeros((gang.size,), dtype=torch.int64, device=gang.device)

    gang.all_gather(flags, torch.tensor([int(flag)], device=gang.device))

    return [bool(f) for f in flags.tolist()]


@contextmanager
def detached_expert_parallel_experts(model: Module) -> Iterator[list[tuple[RoutedExperts, ExpertParallelism]]]:
    """Takes the routed experts of the expert-parallel blocks of ``model`` out
    of it for the duration, so that fairseq2's FSDP2 wrapper neither
    broadcasts nor shards them over all data-parallel ranks, and yields them
    with their blocks' exchanges; they return to their blocks on exit.

    fairseq2 0.8.1's wrapper (``to_fsdp2``) shards every unit over one mesh
    and broadcasts every parameter of a unit it has not wrapped itself; it
    has no hook to keep some parameters out.
    """
    blocks = [m for m in model.modules() if isinstance(m, Qwen35MoeBlock) and m.expert_parallel is not None]

    children = [dict(block._modules) for block in blocks]

    for block in blocks:
        del block._modules["experts"]

    try:
        yield [
            (cast(RoutedExperts, modules["experts"]), cast(ExpertParallelism, block.expert_parallel))
            for block, modules in zip(blocks, children)
        ]
    finally:
        # In their order: the optimizer's state follows that of the
        # parameters.
        for block, modules in zip(blocks, children):
            block._modules.clear()

            block._modules.update(modules)


def shard_expert_parallel_experts(
    experts: RoutedExperts,
    ep: ExpertParallelism,
    *,
    mp_policy: MixedPrecisionPolicy,
    device: torch.device,
    device_type: str,
) -> None:
    """Makes ``experts``, which run where ``ep`` says, an FSDP2 unit over the
    ranks that run the same experts (see the module docstring), with the
    mixed-precision policy of the other units, on a mesh of ``device_type``;
    experts on the meta device are allocated on ``device`` (unless it is the
    meta device) and initialized first."""
    # On the meta device, the whole model stays there until its shards are
    # allocated (`qwen35_fs2.hf.sharded_loading`).
    if device.type != "meta" and any(p.is_meta for p in experts.parameters()):
        experts.to_empty(device=device)

        if ep.received_weights is None:
            experts.reset_parameters()
        else:
            with torch.no_grad():
                for name, weight in ep.received_weights.items():
                    getattr(experts, name).copy_(weight)

            ep.received_weights = None

    replicas = ep.replicas

    mesh = DeviceMesh.from_group(replicas, device_type, mesh_dim_names=("expert_replica",))

    fully_shard(experts, mesh=mesh, mp_policy=mp_policy)

    unit = cast(FSDPModule, experts)

    # The gradients sum the losses of the EP group's ranks; summed over the
    # replicas they sum those of all data-parallel ranks, whose mean is the
    # gradient. Gloo has no pre-multiplied sum, NCCL does not need it here.
    unit.set_gradient_divide_factor(float(ep.ep_size * dist.get_world_size(replicas)))

    unit.set_force_sum_reduction_for_comms(True)


def keep_optimizer_state_on_parameter_meshes(optimizer: Optimizer) -> None:
    """Makes ``optimizer`` put every state DTensor that it loads on the mesh
    and global shape of its parameter.

    A rank's shards of an expert's optimizer state are the same tensors at
    every EP size, but saved as DTensors of the mesh they had: the full
    data-parallel mesh without expert parallelism, a replica mesh with it.
    Loaded as they are into a run at another EP size, they no longer match
    their parameters; their local shards do.

    :raises ValueError: on load, if a state's local shard is not shaped as
        its parameter's.
    """

    def move_to_parameter_meshes(optimizer: Optimizer) -> None:
        for param, state in optimizer.state.items():
            if not isinstance(param, DTensor):
                continue

            for key, value in state.items():
                if not isinstance(value, DTensor) or value.shape == () or value.device_mesh == param.device_mesh and value.shape == param.shape:
                    continue

                local = value.to_local()

                if local.shape != param.to_local().shape:
                    raise ValueError(
                        f"The optimizer state `{key}` of a parameter must have local shards of the parameter's local shape {tuple(param.to_local().shape)}, but has {tuple(local.shape)} instead."
                    )

                state[key] = DTensor.from_local(
                    local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
                )

    optimizer.register_load_state_dict_post_hook(move_to_parameter_meshes)
