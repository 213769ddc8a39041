"""Loads Hugging Face Qwen3.5 checkpoints straight into the FSDP/TP shards of
each rank.

fairseq2 0.8.1 loads a checkpoint on data-parallel rank 0 (the whole model on
its device and, unless memory-mapped, in its host memory) and broadcasts it
while wrapping the model with FSDP. Here every rank builds the model on the
meta device, shards it (tensor parallelism in the modules, FSDP2 with
:func:`~qwen35_fs2.parallel.fsdp.shard_qwen35_with_fsdp2`), allocates only its
own shards, and reads from the safetensors files only the rows (and, for
row-sharded projections, columns) of each tensor that it owns. A rank's
peak memory is then its shards plus a bounded read buffer, on the host and
on its device alike.

Reading uses positional reads, not memory maps: the pages of a mapped file
count as the process's resident memory until it is unmapped, which would add
the rank's share of the checkpoint to its shards.

The Hugging Face layouts are those of the state-dict converters
(:func:`~qwen35_fs2.models.qwen35.interop.convert_qwen35_state_dict` and
:func:`~qwen35_fs2.models.qwen35_moe.interop.convert_qwen35_moe_state_dict`): text
and vision-language keys, the row grouping of the Gated DeltaNet, fused or
per-expert MoE experts, and Qwen3-Next's packed projections. Every fairseq2
tensor is a concatenation of row ranges of Hugging Face tensors
(:func:`plan_hf_rows`); the converters themselves run on meta tensors to
validate the checkpoint, with their own errors, and to check the plan.

In fairseq2's recipes: a recipe that calls
:func:`enable_sharded_checkpoint_loading` in ``Recipe.register`` and
:func:`finish_sharded_checkpoint_loading` in ``Recipe.setup_model`` loads
Hugging Face checkpoints into each rank's shards:

1. the Qwen3.5 families (:class:`~qwen35_fs2.models.family.Qwen35ModelFamily`)
   of the recipe's container return the model on the meta device, on every
   rank, and record its checkpoint in the recipe's
   :class:`ShardedCheckpointLoading`;
2. ``setup_model`` applies layerwise activation checkpointing and FSDP2 as
   the trainer section asks, allocates the rank's shards and reads them;
3. fairseq2 then finds the model sharded: the families' activation
   checkpointing and FSDP appliers leave it as it is.

Native fairseq2 checkpoints, resumed runs (fairseq2 then creates the model on
the meta device and loads its own sharded checkpoint) and recipes that do not
enable it load as before; a resumed LoRA run, whose checkpoints hold the
adapters alone, defers the loading of its base again
(:mod:`qwen35_fs2.recipes.lora`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Final, final
from weakref import WeakKeyDictionary

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn import Module

from fairseq2.data_type import DataType, set_dtype
from fairseq2.error import InternalError
from fairseq2.gang import Gangs, set_gangs
from fairseq2.logging import log
from fairseq2.model_checkpoint import CorruptModelCheckpointError
from fairseq2.models import ModelFamily
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import get_shard_dims
from fairseq2.nn.utils.module import reset_non_persistent_buffers, to_empty
from fairseq2.runtime.dependency import DependencyContainer

from qwen35_fs2.hf.row_plan import RowRange, plan_hf_rows, take_rows
from qwen35_fs2.hf.safetensors import SafetensorsTensor, index_safetensors, matrix_cols, matrix_rows
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.models.qwen35.factory import create_qwen35_model
from qwen35_fs2.models.qwen35.interop import find_output_weight_keys, tied_output_weights_error
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig
from qwen35_fs2.models.qwen35_moe.factory import create_qwen35_moe_model
from qwen35_fs2.nn.lora import is_lora_module, reset_lora_adapters
from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.parallel.ac import apply_ac_to_qwen35
from qwen35_fs2.parallel.fsdp import shard_qwen35_with_fsdp2

if TYPE_CHECKING:
    # `fairseq2.recipe` imports the trainer, wandb and torcheval: 10 s of a
    # process on the test machines' slow hours, in every process that loads
    # this extension (this module is the model family's), recipe or not.
    # Only recipes call what needs it, and import it then.
    from fairseq2.recipe.base import RecipeContext
    from fairseq2.recipe.config import TrainerSection

DEFAULT_READ_BUFFER_BYTES: Final = 64 * 1024 * 1024
"""The largest read of a rank when a slice cannot go straight into its
shard (another dtype or device, or a column range)."""

# Wrappers that insert themselves into parameter names (activation
# checkpointing, `torch.compile`).
_WRAPPER_NAME: Final = re.compile(r"(_checkpoint_wrapped_module|_orig_mod)\.")


@final
@dataclass(frozen=True)
class _LocalBox:
    """The part of a fairseq2 tensor that a rank holds: rows ``[row_start,
    row_start + num_rows)`` of its 2-D view and, for a tensor split by
    columns, columns ``[col_start, col_start + num_cols)``."""

    row_start: int
    num_rows: int
    col_start: int
    num_cols: int


def load_hf_checkpoint_shards(
    model: Module,
    path: Path,
    config: Qwen35Config,
    gangs: Gangs,
    *,
    read_buffer_bytes: int = DEFAULT_READ_BUFFER_BYTES,
) -> None:
    """Fills the parameters of ``model``, a Qwen3.5 model of ``config``
    whose parameters are allocated (tensor-parallel shards under
    ``gangs.tp``, possibly FSDP2 shards), from the Hugging Face checkpoint
    directory ``path``, reading only what this rank holds. Under tied
    embeddings a checkpoint that carries an output projection has it
    compared with its embedding table first (each read whole, in blocks of
    ``read_buffer_bytes``); a difference raises the converter's error before
    any parameter is written.

    Every rank calls it on its own; no collective runs.
    """
    if read_buffer_bytes < 1:
        raise ValueError(
            f"`read_buffer_bytes` must be greater than or equal to 1, but is {read_buffer_bytes} instead."
        )

    index = index_safetensors(path)

    plan = plan_hf_rows({key: tensor.shape for key, tensor in index.items()}, config)

    shard_dims = {_clean_name(name): dim for name, dim in get_shard_dims(model).items()}

    # LoRA adapters are no part of a base checkpoint.
    adapter_params = {id(p) for m in model.modules() if is_lora_module(m) for p in m.parameters()}

    params = {_clean_name(name): param for name, param in model.named_parameters() if id(param) not in adapter_params}

    expert_rows = _expert_parallel_rows(model)

    missing = sorted(params.keys() - plan.keys())
    unexpected = sorted(plan.keys() - params.keys())

    if missing or unexpected:
        raise CorruptModelCheckpointError(
            path, f"The checkpoint at {path} must hold the tensors of the model, but misses {', '.join(missing) or 'none'} and has {', '.join(unexpected) or 'none'} too."
        )

    with _SafetensorsReader(index, read_buffer_bytes) as reader, torch.no_grad():
        # Before any parameter is written: nothing is half-loaded on error.
        if config.tied_embeddings:
            _check_tied_output_weights(index, reader, read_buffer_bytes)

        for name, param in params.items():
            local, full_shape, box = _local_box(param, shard_dims.get(name), gangs, expert_rows.get(name))

            _check_plan_shape(path, name, plan[name], full_shape, index)

            if local.numel() == 0:
                continue

            # (R_l, C_l)
            target = local.detach().view(box.num_rows, box.num_cols)

            offset = 0

            for r in take_rows(plan[name], box.row_start, box.num_rows):
                reader.read(r, box.col_start, box.num_cols, target[offset : offset + r.length])

                offset += r.length



def _check_tied_output_weights(
    index: Mapping[str, SafetensorsTensor], reader: _SafetensorsReader, read_buffer_bytes: int
) -> None:
    """Runs the check of :func:`~qwen35_fs2.models.qwen35.interop.check_tied_output_weights`,
    which :func:`plan_hf_rows` ran on meta tensors, on the data: reads the
    embedding table and the output projection, if the checkpoint has one, in
    blocks of rows of at most ``read_buffer_bytes`` each and compares them."""
    keys = find_output_weight_keys(index)

    if keys is None:
        return

    embed_key, output_key = keys

    embed, output = index[embed_key], index[output_key]

    if embed.shape != output.shape:
        raise tied_output_weights_error(embed_key, output_key)

    dtype = torch.promote_types(embed.dtype, output.dtype)

    num_cols = embed.num_cols

    rows_per_read = max(1, read_buffer_bytes // (num_cols * dtype.itemsize))

    # (R, C)
    embed_rows = torch.empty((rows_per_read, num_cols), dtype=dtype)
    output_rows = torch.empty((rows_per_read, num_cols), dtype=dtype)

    for start in range(0, embed.num_rows, rows_per_read):
        num_rows = min(rows_per_read, embed.num_rows - start)

        reader.read(RowRange(embed_key, start, num_rows), 0, num_cols, embed_rows[:num_rows])
        reader.read(RowRange(output_key, start, num_rows), 0, num_cols, output_rows[:num_rows])

        if not torch.equal(embed_rows[:num_rows], output_rows[:num_rows]):
            raise tied_output_weights_error(embed_key, output_key)


def _clean_name(name: str) -> str:
    return _WRAPPER_NAME.sub("", name)


def _expert_parallel_rows(model: Module) -> dict[str, tuple[list[int], int]]:
    """Returns, by name, the routed experts of the expert-parallel blocks of
    ``model``: the experts in the rows of the parameter and the number of
    experts of the tensor-parallel rank."""
    rows = {}

    for name, module in model.named_modules():
        if isinstance(module, Qwen35MoeBlock) and module.expert_parallel is not None:
            ep = module.expert_parallel

            for param_name in ("gate_inner_proj", "output_proj"):
                rows[_clean_name(f"{name}.experts.{param_name}")] = (ep.rank_experts, ep.num_experts)

    return rows


def _local_box(
    param: Tensor, tp_dim: int | None, gangs: Gangs, expert_rows: tuple[list[int], int] | None = None
) -> tuple[Tensor, tuple[int, ...], _LocalBox]:
    """Returns this rank's tensor of ``param``, the shape of the unsharded
    tensor, and where the rank's tensor lies in it (in the rows and columns
    of its 2-D view).

    The rows of the stacked weights of an expert-parallel rank's experts are
    ``expert_rows[0]`` of the tensor-parallel rank's ``expert_rows[1]``."""
    if isinstance(param, DTensor):
        local = param.to_local()

        shape, global_offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        local = param

        shape, global_offsets = tuple(param.shape), (0,) * param.ndim

    offsets = list(global_offsets)

    param_shape = list(param.shape)

    if expert_rows is not None:
        rank_experts, param_shape[0] = expert_rows

        rows = rank_experts[offsets[0] : offsets[0] + shape[0]]

        # The placement gives every rank consecutive experts.
        if rows and rows != list(range(rows[0], rows[0] + len(rows))):
            raise InternalError(f"The experts of a rank must be consecutive, but are {rows}.")

        offsets[0] = rows[0] if rows else 0

    if tp_dim is not None:
        offsets[tp_dim] += gangs.tp.rank * param_shape[tp_dim]

    full_shape = list(param_shape)

    if tp_dim is not None:
        full_shape[tp_dim] *= gangs.tp.size

    # Only the first dimension and the columns of a 2-D tensor may be split.
    for dim in range(1, param.ndim):
        if (param.ndim != 2 or dim != 1) and shape[dim] != full_shape[dim]:
            raise InternalError(f"Dimension {dim} of a parameter of shape {tuple(param.shape)} is split.")

    inner = prod(full_shape[1:-1]) if param.ndim > 2 else 1

    if param.ndim == 2:
        col_start, num_cols = offsets[1], shape[1]
    else:
        col_start, num_cols = 0, matrix_cols(tuple(full_shape))

    box = _LocalBox(offsets[0] * inner, shape[0] * inner, col_start, num_cols)

    return local, tuple(full_shape), box


def _check_plan_shape(
    path: Path, name: str, ranges: list[RowRange], shape: tuple[int, ...], index: Mapping[str, SafetensorsTensor]
) -> None:
    """Checks that the checkpoint tensors of ``name`` make up a tensor of
    ``shape``, as fairseq2's loader does."""
    num_rows = sum(r.length for r in ranges)

    num_cols = {index[r.key].num_cols for r in ranges}

    if num_rows != matrix_rows(shape) or num_cols != {matrix_cols(shape)}:
        keys = ", ".join(dict.fromkeys(r.key for r in ranges))

        raise CorruptModelCheckpointError(
            path, f"`{name}` must have a shape of {shape} in the model, but its checkpoint tensors ({keys}) make up {num_rows} rows of {' or '.join(map(str, sorted(num_cols)))} columns."
        )


@final
class _SafetensorsReader:
    """Reads row ranges of safetensors tensors with positional reads, into a
    target directly when it is a contiguous CPU tensor of the file's dtype,
    otherwise through a buffer of at most ``buffer_bytes``."""

    def __init__(self, index: Mapping[str, SafetensorsTensor], buffer_bytes: int) -> None:
        self._index = index
        self._buffer_bytes = buffer_bytes
        self._buffer: Tensor | None = None
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> _SafetensorsReader:
        return self

    def __exit__(self, *args: object) -> None:
        for fd in self._fds.values():
            os.close(fd)

        self._fds.clear()

        self._buffer = None

    def read(self, r: RowRange, col_start: int, num_cols: int, target: Tensor) -> None:
        """Copies columns ``[col_start, col_start + num_cols)`` of rows ``r``
        into ``target`` (*Shape:* :math:`(r.length, num\\_cols)`)."""
        tensor = self._index[r.key]

        row_bytes = tensor.num_cols * tensor.dtype.itemsize

        whole_rows = col_start == 0 and num_cols == tensor.num_cols

        direct = whole_rows and target.device.type == "cpu" and target.dtype == tensor.dtype and target.is_contiguous()

        if direct:
            self._pread(tensor, r.start * row_bytes, _as_bytes(target))

            return

        rows_per_read = max(1, self._buffer_bytes // row_bytes)

        for begin in range(0, r.length, rows_per_read):
            num_rows = min(rows_per_read, r.length - begin)

            buffer = self._get_buffer(num_rows * row_bytes)

            self._pread(tensor, (r.start + begin) * row_bytes, buffer)

            # (R, C) -> (R, C_l)
            rows = buffer.view(tensor.dtype).view(num_rows, tensor.num_cols)

            target[begin : begin + num_rows].copy_(rows[:, col_start : col_start + num_cols])

    def _get_buffer(self, num_bytes: int) -> Tensor:
        if self._buffer is None or self._buffer.numel() < num_bytes:
            self._buffer = torch.empty((num_bytes,), dtype=torch.uint8)

        return self._buffer[:num_bytes]

    def _pread(self, tensor: SafetensorsTensor, offset: int, target: Tensor) -> None:
        fd = self._fds.get(tensor.file)

        if fd is None:
            fd = self._fds[tensor.file] = os.open(tensor.file, os.O_RDONLY)

        view = memoryview(target.numpy()).cast("B")  # type: ignore[arg-type]

        done = 0

        while done < len(view):
            num_read = os.preadv(fd, [view[done:]], tensor.offset + offset + done)

            if num_read == 0:
                raise CorruptModelCheckpointError(tensor.file, f"{tensor.file} ends before the data of its tensors.")

            done += num_read


def _as_bytes(tensor: Tensor) -> Tensor:
    return tensor.view(-1).view(torch.uint8)


def create_sharded_qwen35_model(
    config: Qwen35Config,
    gangs: Gangs,
    *,
    dtype: DataType = torch.float32,
    fsdp_granularity: str | None = "layer",
    mixed_precision_dtype: DataType | None = None,
    fp32_reduce: bool = False,
    reshard_after_forward: bool = True,
) -> TransformerLM:
    """Creates the model of ``config`` with only this rank's shards allocated
    on ``gangs.root.device``, left uninitialized: tensor parallel under
    ``gangs.tp`` and, if ``gangs.sdp`` has more than one rank and
    ``fsdp_granularity`` is not ``None``, sharded with FSDP2 (see
    :func:`~qwen35_fs2.parallel.fsdp.shard_qwen35_with_fsdp2` for the other
    options)."""
    with torch.device("meta"), set_gangs(gangs, meta=True), set_dtype(dtype):
        if isinstance(config, Qwen35MoeConfig):
            model = create_qwen35_moe_model(config)
        else:
            model = create_qwen35_model(config)

    allocate_shards(
        model,
        gangs,
        fsdp_granularity=fsdp_granularity,
        mixed_precision_dtype=mixed_precision_dtype,
        fp32_reduce=fp32_reduce,
        reshard_after_forward=reshard_after_forward,
    )

    return model


def allocate_shards(
    model: TransformerLM,
    gangs: Gangs,
    *,
    fsdp_granularity: str | None = "layer",
    mixed_precision_dtype: DataType | None = None,
    fp32_reduce: bool = False,
    reshard_after_forward: bool = True,
) -> None:
    """Shards ``model``, built on the meta device under ``gangs``, with
    FSDP2 (as :func:`create_sharded_qwen35_model` does) and allocates this
    rank's shards on ``gangs.root.device``, uninitialized."""
    device = gangs.root.device

    if fsdp_granularity is not None and gangs.sdp.size > 1:
        sharded = shard_qwen35_with_fsdp2(
            model,
            gangs,
            granularity=fsdp_granularity,
            mixed_precision_dtype=mixed_precision_dtype,
            fp32_reduce=fp32_reduce,
            reshard_after_forward=reshard_after_forward,
        )

        # FSDP2 keeps tied parameters tied through `to_empty`.
        sharded.to_empty(device=device)  # type: ignore[attr-defined]
    else:
        to_empty(model, device)

    # They are no part of a checkpoint.
    reset_non_persistent_buffers(model)


@final
@dataclass(frozen=True)
class DeferredCheckpoint:
    """A Hugging Face checkpoint whose loading a family left to the recipe."""

    path: Path

    config: Qwen35Config


@final
@dataclass(frozen=True)
class MetaModelOrigin:
    """The family and configuration of a model that a Qwen3.5 family created
    on the meta device: what loading a checkpoint into a model like it takes
    (as a resumed LoRA run reads its base again, :mod:`qwen35_fs2.recipes.lora`)."""

    family: ModelFamily

    config: Qwen35Config


@final
class ShardedCheckpointLoading:
    """The Hugging Face checkpoints whose loading the Qwen3.5 families deferred
    until their models are sharded, by model.

    A recipe registers one in its container
    (:func:`enable_sharded_checkpoint_loading`); the families created by that
    container then return the models of Hugging Face checkpoints on the meta
    device and record their checkpoint here, and the recipe loads them
    (:func:`finish_sharded_checkpoint_loading`).
    """

    def __init__(self) -> None:
        self._checkpoints: WeakKeyDictionary[Module, DeferredCheckpoint] = WeakKeyDictionary()
        self._origins: WeakKeyDictionary[Module, MetaModelOrigin] = WeakKeyDictionary()

    def defer(self, model: Module, checkpoint: DeferredCheckpoint) -> None:
        """Records that ``model``, on the meta device, is to be loaded from
        ``checkpoint``; a weak reference, so that a model dropped before its
        loading takes its record with it."""
        self._checkpoints[model] = checkpoint

    def get(self, model: Module) -> DeferredCheckpoint | None:
        """Returns the checkpoint deferred for ``model``; ``None`` if there is
        none."""
        return self._checkpoints.get(model)

    def take(self, model: Module) -> DeferredCheckpoint | None:
        """Returns the checkpoint deferred for ``model``, and forgets it;
        ``None`` if there is none."""
        return self._checkpoints.pop(model, None)

    def record_origin(self, model: Module, origin: MetaModelOrigin) -> None:
        """Records the family and configuration of ``model``, which a family
        created on the meta device (a weak reference, as :meth:`defer`)."""
        self._origins[model] = origin

    def get_origin(self, model: Module) -> MetaModelOrigin | None:
        """Returns the family and configuration of ``model``; ``None`` if no
        family recorded them."""
        return self._origins.get(model)


def enable_sharded_checkpoint_loading(container: DependencyContainer) -> None:
    """Makes the Qwen3.5 families defer loading Hugging Face checkpoints to
    :func:`finish_sharded_checkpoint_loading`; call it in
    ``Recipe.register``."""
    container.register_instance(ShardedCheckpointLoading, ShardedCheckpointLoading())


def finish_sharded_checkpoint_loading(context: RecipeContext, model: Module) -> Module:
    """Shards ``model`` and reads its checkpoint into the shards if its family
    deferred the loading; returns ``model``, otherwise untouched. Call it in
    ``Recipe.setup_model`` before anything else uses the model.

    With FSDP (``trainer.data_parallelism: fsdp`` over more than one rank)
    the model is sharded as the trainer section asks (``fsdp.granularity``
    ``layer`` or ``stack``, ``reshard_after_forward``, ``fp32_reduce``, static
    mixed precision) after layerwise activation checkpointing, if any; with
    DDP or a single data-parallel rank, every rank reads its tensor-parallel
    shard in full.
    """
    loading = context.resolver.maybe_resolve(ShardedCheckpointLoading)

    pending = None if loading is None else loading.take(model)

    if pending is None:
        return model

    if not isinstance(model, TransformerLM):
        raise TypeError(f"`model` must be a `TransformerLM`, but is a `{type(model).__name__}` instead.")

    from fairseq2.recipe.config import TrainerSection

    gangs = context.gangs

    trainer = context.resolver.resolve(TrainerSection)

    if _uses_fsdp(trainer, gangs):
        fsdp = trainer.fsdp

        if fsdp.version != "v2":
            raise ValueError(
                f"`trainer.fsdp.version` must be 'v2' to load a checkpoint into FSDP shards, but is '{fsdp.version}' instead."
            )

        # fairseq2 wraps the whole model itself at this granularity, broadcasting
        # from rank 0.
        if fsdp.granularity not in ("layer", "stack"):
            raise ValueError(
                f"`trainer.fsdp.granularity` must be 'layer' or 'stack' to load a checkpoint into FSDP shards, but is '{fsdp.granularity}' instead."
            )

        ac = trainer.activation_checkpointing

        # Activation checkpointing goes inside the FSDP units, as fairseq2
        # applies it.
        if ac.mode == "layerwise":
            apply_ac_to_qwen35(model, ac.every_nth_layer)

        mixed_precision = trainer.mixed_precision

        allocate_shards(
            model,
            gangs,
            fsdp_granularity=fsdp.granularity,
            mixed_precision_dtype=mixed_precision.dtype if mixed_precision.mode == "static" else None,
            fp32_reduce=fsdp.fp32_reduce,
            reshard_after_forward=fsdp.reshard_after_forward,
        )
    else:
        allocate_shards(model, gangs, fsdp_granularity=None)

    load_hf_checkpoint_shards(model, pending.path, pending.config, gangs)

    # Adapters put on the model before it was sharded (`lora` in the
    # recipes) are allocated uninitialized.
    reset_lora_adapters(model)

    log.info("Every rank read its shards of {}.", pending.path)

    return model


def _uses_fsdp(trainer: TrainerSection, gangs: Gangs) -> bool:
    """Whether fairseq2's data-parallel wrapper would use FSDP."""
    if gangs.dp.size == 1 or trainer.data_parallelism != "fsdp":
        return False

    # fairseq2 falls back to DDP.
    return not (gangs.rdp.size > 1 and gangs.sdp.size == 1)
