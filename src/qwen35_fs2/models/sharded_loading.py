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
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Final, final

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn import Module

from fairseq2.data_type import DataType, set_dtype
from fairseq2.error import InternalError, StateDictError
from fairseq2.gang import Gangs, set_gangs
from fairseq2.model_checkpoint import CorruptModelCheckpointError
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.models.utils.checkpoint import convert_state_dict
from fairseq2.nn import get_shard_dims
from fairseq2.nn.utils.module import reset_non_persistent_buffers, to_empty

from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.models.qwen35.factory import create_qwen35_model
from qwen35_fs2.parallel.fsdp import shard_qwen35_with_fsdp2
from qwen35_fs2.models.qwen35.interop import (
    _GROUPED_QKV_KEY,
    _HG_KEY_MAP,
    convert_qwen35_state_dict,
    find_output_weight_keys,
    is_hg_state_dict,
    qkv_row_segments,
    strip_vlm_prefix,
    tied_output_weights_error,
)
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig
from qwen35_fs2.models.qwen35_moe.factory import create_qwen35_moe_model
from qwen35_fs2.models.qwen35_moe.interop import (
    _HG_MOE_KEY_MAP,
    _MOE_KEY,
    _PER_EXPERT_KEY,
    convert_qwen35_moe_state_dict,
)
from qwen35_fs2.models.qwen3_next.interop import _PACKED_KEY

DEFAULT_READ_BUFFER_BYTES: Final = 64 * 1024 * 1024
"""The largest read of a rank when a slice cannot go straight into its
shard (another dtype or device, or a column range)."""

_SAFETENSORS_DTYPES: Final = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# Wrappers that insert themselves into parameter names (activation
# checkpointing, `torch.compile`).
_WRAPPER_NAME: Final = re.compile(r"(_checkpoint_wrapped_module|_orig_mod)\.")


@final
@dataclass(frozen=True)
class SafetensorsTensor:
    """Where a tensor lies in a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """The byte offset of its data in :attr:`file`."""

    @property
    def num_rows(self) -> int:
        return _num_rows(self.shape)

    @property
    def num_cols(self) -> int:
        return _num_cols(self.shape)


def _num_rows(shape: tuple[int, ...]) -> int:
    """The rows of ``shape`` viewed as 2-D: all dimensions but the last."""
    return prod(shape[:-1]) if len(shape) > 1 else prod(shape)


def _num_cols(shape: tuple[int, ...]) -> int:
    return shape[-1] if len(shape) > 1 else 1


def index_safetensors(
    path: Path, files: Sequence[Path] | None = None
) -> dict[str, SafetensorsTensor]:
    """Reads the headers of the safetensors files of the directory ``path``
    (only the headers: no tensor data).

    :param files: The files to read; all ``*.safetensors`` files of ``path``
        if ``None``.
    """
    if files is None:
        files = sorted(path.glob("*.safetensors"))

    if not files:
        raise CorruptModelCheckpointError(
            path, f"{path} must contain safetensors checkpoint files, but has none."
        )

    index: dict[str, SafetensorsTensor] = {}

    for file in files:
        for key, tensor in _read_safetensors_header(file).items():
            if key in index:
                raise CorruptModelCheckpointError(
                    path, f"`{key}` must be in one safetensors file of {path}, but is in {index[key].file.name} and {file.name}."
                )

            index[key] = tensor

    return index


def _read_safetensors_header(file: Path) -> dict[str, SafetensorsTensor]:
    def corrupt(reason: str) -> CorruptModelCheckpointError:
        return CorruptModelCheckpointError(
            file, f"{file} cannot be loaded as a safetensors checkpoint file: {reason}"
        )

    file_size = file.stat().st_size

    with file.open("rb") as fp:
        prefix = fp.read(8)

        if len(prefix) != 8:
            raise corrupt("the file is shorter than its header.")

        (header_size,) = struct.unpack("<Q", prefix)

        if 8 + header_size > file_size:
            raise corrupt("the file is shorter than its header.")

        try:
            header = json.loads(fp.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError) as ex:
            raise corrupt(f"its header is not valid JSON ({ex}).") from None

    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object.")

    data_start = 8 + header_size

    tensors = {}

    for key, entry in header.items():
        if key == "__metadata__":
            continue

        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]

            shape = tuple(int(size) for size in entry["shape"])

            begin, end = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"the header entry of `{key}` ({entry}) is not a tensor of a supported dtype.") from None

        num_bytes = prod(shape) * dtype.itemsize

        if end - begin != num_bytes or data_start + end > file_size:
            raise corrupt(f"`{key}` must take {num_bytes} bytes within the file, but takes bytes {begin} to {end} of its data.")

        tensors[key] = SafetensorsTensor(file, dtype, shape, data_start + begin)

    return tensors


@final
@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, start + length)`` of the Hugging Face tensor ``key``,
    viewed as 2-D (all dimensions but the last are rows)."""

    key: str
    start: int
    length: int


RowPlan = dict[str, list[RowRange]]
"""Maps each fairseq2 tensor to the row ranges whose concatenation it is."""


def plan_hf_rows(shapes: Mapping[str, tuple[int, ...]], config: Qwen35Config) -> RowPlan:
    """Returns, for every tensor of the fairseq2 state dict of a Hugging Face
    checkpoint whose tensors have ``shapes``, the row ranges it is made of.

    Raises the converters' :class:`StateDictError` for a checkpoint that does
    not match ``config``.
    """
    if not is_hg_state_dict(shapes):
        raise StateDictError(
            "The checkpoint must be a Hugging Face Qwen3.5 checkpoint (with `model.embed_tokens.weight` or `model.language_model.embed_tokens.weight`), but is not."
        )

    _check_with_converter(shapes, config)

    # Text-only layout keys -> the rows of the checkpoint's tensors.
    plan: RowPlan = {
        text_key: [RowRange(key, 0, _num_rows(shapes[key]))]
        for text_key, key in strip_vlm_prefix({key: key for key in shapes}).items()
        if isinstance(key, str)
    }

    plan = _unpack_qwen3_next_rows(plan, config)

    moe_plan: RowPlan = {}

    if isinstance(config, Qwen35MoeConfig):
        for key in list(plan):
            match = _MOE_KEY.match(key)

            if match is not None and config.is_moe_layer(int(match.group(1))):
                moe_plan[key] = plan.pop(key)

        moe_plan = _fuse_expert_rows(moe_plan, config)

    if config.tied_embeddings:
        plan.pop("lm_head.weight", None)

    fs2_plan: RowPlan = {}

    for key_map, part in ((_HG_KEY_MAP, plan), (_HG_MOE_KEY_MAP, moe_plan)):
        for key, ranges in convert_state_dict(dict(part), key_map).items():
            if not isinstance(ranges, list):
                raise InternalError(f"The row plan of `{key}` is of type `{type(ranges)}`.")

            fs2_plan[key] = ranges

    for key, ranges in fs2_plan.items():
        if _GROUPED_QKV_KEY.match(key):
            fs2_plan[key] = [r for start, length in qkv_row_segments(config) for r in _take_rows(ranges, start, length)]

    return fs2_plan


def _check_with_converter(shapes: Mapping[str, tuple[int, ...]], config: Qwen35Config) -> None:
    """Runs the state-dict converter on meta tensors of ``shapes``: it raises
    its errors for keys and shapes that do not match ``config``."""
    state_dict: dict[str, object] = {
        key: torch.empty(shape, device="meta") for key, shape in shapes.items()
    }

    if isinstance(config, Qwen35MoeConfig):
        convert_qwen35_moe_state_dict(state_dict, config)
    else:
        convert_qwen35_state_dict(state_dict, config)


def _take_rows(ranges: list[RowRange], start: int, length: int) -> list[RowRange]:
    """Returns rows ``[start, start + length)`` of the concatenation of
    ``ranges``."""
    taken = []

    offset = 0

    for r in ranges:
        begin = max(start, offset)
        end = min(start + length, offset + r.length)

        if begin < end:
            taken.append(RowRange(r.key, r.start + begin - offset, end - begin))

        offset += r.length

    if sum(r.length for r in taken) != length:
        raise InternalError(f"Rows {start} to {start + length} are out of the {offset} rows of {ranges}.")

    return taken


def _per_group_rows(ranges: list[RowRange], num_groups: int, sizes: list[int]) -> list[list[RowRange]]:
    """Splits the rows of each of ``num_groups`` consecutive groups into
    parts of ``sizes`` and concatenates each part over the groups (the rows
    of :func:`qwen35_fs2.models.qwen3_next.interop._split_per_key_head`)."""
    group_size = sum(sizes)

    parts: list[list[RowRange]] = [[] for _ in sizes]

    for group_idx in range(num_groups):
        offset = group_idx * group_size

        for part, size in zip(parts, sizes):
            part.extend(_take_rows(ranges, offset, size))

            offset += size

    return parts


def _unpack_qwen3_next_rows(plan: RowPlan, config: Qwen35Config) -> RowPlan:
    """The rows of :func:`qwen35_fs2.models.qwen3_next.interop.unpack_qwen3_next_projections`."""
    num_key_heads = config.num_linear_key_heads

    ratio = config.num_linear_value_heads // num_key_heads

    value_group_dim = ratio * config.linear_value_head_dim

    key_head_dim = config.linear_key_head_dim

    unpacked: RowPlan = {}

    for key, ranges in plan.items():
        match = _PACKED_KEY.match(key)

        if match is None:
            unpacked[key] = ranges

            continue

        prefix, name = match.groups()

        if name == "in_proj_qkvz":
            q, k, v, z = _per_group_rows(ranges, num_key_heads, [key_head_dim, key_head_dim, value_group_dim, value_group_dim])

            unpacked[prefix + "in_proj_qkv.weight"] = q + k + v
            unpacked[prefix + "in_proj_z.weight"] = z
        else:
            b, a = _per_group_rows(ranges, num_key_heads, [ratio, ratio])

            unpacked[prefix + "in_proj_b.weight"] = b
            unpacked[prefix + "in_proj_a.weight"] = a

    return unpacked


def _fuse_expert_rows(plan: RowPlan, config: Qwen35MoeConfig) -> RowPlan:
    """The rows of the fused expert tensors of
    :func:`qwen35_fs2.models.qwen35_moe.interop.convert_qwen35_moe_state_dict`:
    ``gate_up_proj`` :math:`(E, 2I, M)` viewed as :math:`(E·2I, M)` is, per
    expert, its gate then its up rows; ``down_proj`` its down rows."""
    fused: RowPlan = {}

    # layer prefix -> {(expert index, projection): rows}
    per_expert: dict[str, dict[tuple[int, str], list[RowRange]]] = {}

    for key, ranges in plan.items():
        match = _PER_EXPERT_KEY.match(key)

        if match is None:
            fused[key] = ranges

            continue

        layer_idx, expert_idx, projection = match.groups()

        prefix = f"model.layers.{layer_idx}.mlp.experts."

        per_expert.setdefault(prefix, {})[(int(expert_idx), projection)] = ranges

    for prefix, tensors in per_expert.items():
        experts = range(config.experts.num_experts)

        fused[prefix + "gate_up_proj"] = [
            r for e in experts for projection in ("gate_proj", "up_proj") for r in tensors[(e, projection)]
        ]

        fused[prefix + "down_proj"] = [r for e in experts for r in tensors[(e, "down_proj")]]

    return fused


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

    params = {_clean_name(name): param for name, param in model.named_parameters()}

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
            local, full_shape, box = _local_box(param, shard_dims.get(name), gangs)

            _check_plan_shape(path, name, plan[name], full_shape, index)

            if local.numel() == 0:
                continue

            # (R_l, C_l)
            target = local.detach().view(box.num_rows, box.num_cols)

            offset = 0

            for r in _take_rows(plan[name], box.row_start, box.num_rows):
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


def _local_box(param: Tensor, tp_dim: int | None, gangs: Gangs) -> tuple[Tensor, tuple[int, ...], _LocalBox]:
    """Returns this rank's tensor of ``param``, the shape of the unsharded
    tensor, and where the rank's tensor lies in it (in the rows and columns
    of its 2-D view)."""
    if isinstance(param, DTensor):
        local = param.to_local()

        shape, global_offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        local = param

        shape, global_offsets = tuple(param.shape), (0,) * param.ndim

    offsets = list(global_offsets)

    if tp_dim is not None:
        offsets[tp_dim] += gangs.tp.rank * param.size(tp_dim)

    full_shape = list(param.shape)

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
        col_start, num_cols = 0, _num_cols(tuple(full_shape))

    box = _LocalBox(offsets[0] * inner, shape[0] * inner, col_start, num_cols)

    return local, tuple(full_shape), box


def _check_plan_shape(
    path: Path, name: str, ranges: list[RowRange], shape: tuple[int, ...], index: Mapping[str, SafetensorsTensor]
) -> None:
    """Checks that the checkpoint tensors of ``name`` make up a tensor of
    ``shape``, as fairseq2's loader does."""
    num_rows = sum(r.length for r in ranges)

    num_cols = {index[r.key].num_cols for r in ranges}

    if num_rows != _num_rows(shape) or num_cols != {_num_cols(shape)}:
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
