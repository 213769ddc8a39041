"""Writing an export plan as a Hugging Face repository, atomically."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Final, final

from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import Tensor

from qwen35_fs2.hf.export.plan import HfExportPlan
from qwen35_fs2.hf.export.repository import HfExportError, HfRepository, numel
from qwen35_fs2.hf.safetensors import SAFETENSORS_INDEX_FILE, SafetensorsTensor

DEFAULT_MAX_SHARD_SIZE: Final = 5_000_000_000
"""The largest shard, in bytes, as in ``save_pretrained`` (``"5GB"``)."""


def write_hf_export(
    plan: HfExportPlan,
    out_dir: str | Path,
    *,
    force: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Writes ``plan`` as a Hugging Face repository at ``out_dir``.

    The repository is written into a hidden temporary directory next to
    ``out_dir`` and renamed into place once complete, so ``out_dir`` never
    holds a partial export; on any failure the temporary directory is removed.

    :param force: If ``True``, replaces a non-empty ``out_dir``; otherwise
        that is an error.
    :param max_shard_size: The largest shard in bytes; a larger tensor gets a
        shard of its own.
    """
    if max_shard_size < 1:
        raise ValueError(
            f"`max_shard_size` must be greater than or equal to 1, but is {max_shard_size} instead."
        )

    out_dir = Path(out_dir).absolute()

    check_output_dir(out_dir, base=plan.base, force=force)

    with StagingDir(out_dir) as staging_dir:
        _write_shards(plan, staging_dir.path, max_shard_size)

        _write_json(staging_dir.path / "config.json", plan.config)

        if plan.generation_config is not None:
            _write_json(staging_dir.path / "generation_config.json", plan.generation_config)

        for file in plan.copied_files:
            shutil.copyfile(file, staging_dir.path / file.name)

            _fsync(staging_dir.path / file.name)

        staging_dir.commit()


def check_output_dir(
    out_dir: str | Path, *, base: HfRepository | None = None, force: bool = False
) -> None:
    """Raises :class:`HfExportError` if an export may not be written to
    ``out_dir``; checked again on writing, and before loading a model by the
    command line, so that it fails early."""
    out_dir = Path(out_dir).absolute()

    if out_dir.exists() and not out_dir.is_dir():
        raise HfExportError(
            f"The output must be a directory, but {out_dir} is a file."
        )

    if base is not None:
        base_path = base.path.resolve()

        if out_dir.resolve() == base_path or out_dir.resolve() in base_path.parents:
            raise HfExportError(
                f"The output directory must not hold the base model, but {out_dir} holds {base.path}."
            )

    if not force and out_dir.is_dir() and any(out_dir.iterdir()):
        raise HfExportError(
            f"The output directory must be empty or absent, but {out_dir} has files. Replace them with `--force` (`force=True` in Python)."
        )


@final
class StagingDir:
    """A hidden directory next to the output that becomes the output on
    :meth:`commit` (replacing a directory that is there whole) and is
    removed otherwise; it must hold a JSON file by then."""

    def __init__(self, out_dir: Path) -> None:
        self._out_dir = out_dir
        self._path: Path | None = None
        self._created_parents: list[Path] = []
        self._committed = False

    def __enter__(self) -> StagingDir:
        parent = self._out_dir.parent

        missing = [p for p in (parent, *parent.parents) if not p.exists()]

        try:
            for directory in reversed(missing):
                directory.mkdir()

                self._created_parents.append(directory)

            self._path = _make_unique_dir(parent, f".{self._out_dir.name}", ".partial")
        except OSError as ex:
            self._remove_created_parents()

            raise HfExportError(
                f"The export cannot be written next to {self._out_dir}: {ex.strerror or ex}."
            ) from ex

        return self

    @property
    def path(self) -> Path:
        if self._path is None:
            raise RuntimeError("The staging directory is used outside its `with` block.")

        return self._path

    def commit(self) -> None:
        staging_path = self.path

        # safetensors creates its files private to their owner; they get the
        # mode of the JSON files (`config.json`, `adapter_config.json`), that
        # of any file the user creates.
        file_mode = min(staging_path.glob("*.json")).stat().st_mode & 0o777

        for file in staging_path.glob("*.safetensors"):
            file.chmod(file_mode)

        _fsync(staging_path)

        out_dir = self._out_dir

        if out_dir.is_dir() and any(out_dir.iterdir()):
            # Replaced with `force`: moved aside first, so that a crash between
            # the two renames leaves the old export recoverable, never a mix.
            old_dir = _make_unique_dir(out_dir.parent, f".{out_dir.name}", ".old")

            out_dir.rename(old_dir / out_dir.name)

            staging_path.rename(out_dir)

            shutil.rmtree(old_dir)
        else:
            # Renaming onto an empty directory replaces it atomically.
            os.replace(staging_path, out_dir)

        _fsync(out_dir.parent)

        self._committed = True

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._committed:
            return

        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)

        self._remove_created_parents()

        if isinstance(exc, (OSError, SafetensorError)):
            raise HfExportError(
                f"Writing the export to {self._out_dir} failed, and nothing was left behind: {exc}"
            ) from exc

    def _remove_created_parents(self) -> None:
        for directory in reversed(self._created_parents):
            try:
                directory.rmdir()
            except OSError:
                break


def _make_unique_dir(parent: Path, prefix: str, suffix: str) -> Path:
    """Creates a new directory, with the mode of any directory the user
    creates (unlike ``tempfile.mkdtemp``, which makes it private)."""
    while True:
        path = parent / f"{prefix}.{secrets.token_hex(4)}{suffix}"

        try:
            path.mkdir()
        except FileExistsError:
            continue

        return path


def _write_shards(plan: HfExportPlan, staging_dir: Path, max_shard_size: int) -> None:
    shards: list[list[str]] = []

    shard_size = 0

    for key, tensor in plan.tensors.items():
        if not shards or (shard_size > 0 and shard_size + tensor.num_bytes > max_shard_size):
            shards.append([])

            shard_size = 0

        shards[-1].append(key)

        shard_size += tensor.num_bytes

    weight_map = {}

    for shard_idx, keys in enumerate(shards):
        name = f"model-{shard_idx + 1:05d}-of-{len(shards):05d}.safetensors"

        save_file(_materialize(plan, keys), staging_dir / name, metadata={"format": "pt"})

        _fsync(staging_dir / name)

        for key in keys:
            weight_map[key] = name

    index = {
        "metadata": {
            "total_size": sum(t.num_bytes for t in plan.tensors.values()),
            "total_parameters": sum(numel(t.shape) for t in plan.tensors.values()),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }

    _write_json(staging_dir / SAFETENSORS_INDEX_FILE, index)


def _materialize(plan: HfExportPlan, keys: Sequence[str]) -> dict[str, Tensor]:
    """Returns the tensors of one shard on the CPU in their export dtypes,
    each in storage of its own as safetensors requires."""
    copied_entries = {k: source for k in keys if isinstance(source := plan.tensors[k].source, SafetensorsTensor)}

    if copied_entries:
        if plan.base is None:
            raise RuntimeError("A tensor to copy from the base has no base.")

        copied = plan.base.read(copied_entries)
    else:
        copied = {}

    tensors = {}

    for key in keys:
        planned = plan.tensors[key]

        source = planned.source if isinstance(planned.source, Tensor) else copied[key]

        tensors[key] = source.detach().to(device="cpu", dtype=planned.dtype, copy=True).contiguous()

    return tensors


def _write_json(file: Path, document: object) -> None:
    file.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    _fsync(file)


def _fsync(path: Path) -> None:
    """Flushes ``path`` to disk, so that the final rename publishes complete
    files even across a power loss."""
    fd = os.open(path, os.O_RDONLY)

    try:
        os.fsync(fd)
    finally:
        os.close(fd)
