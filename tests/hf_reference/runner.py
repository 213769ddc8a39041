"""Runs requests against the transformers Qwen3.5 reference in a subprocess.

Requests are collected in an :class:`HfReferenceBatch`; the one-shot
functions below are batches of one request. A test process starts one
reference subprocess and hands it its batches until the test module ends
(``fixtures.one_hf_reference_subprocess_a_module``): each start imports
PyTorch and transformers, about 3 s on a usual day and 20 to 30 s in the
test machines' slow hours, and the suite runs dozens of batches.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Generic, Literal, TypeVar, final

import torch
from safetensors.torch import load_file

from .overlay import ensure_hf_reference
from .spec import ReferencePrecision, TinyQwen35Spec

ModelClass = Literal["auto", "conditional_generation"]
"""
``"auto"`` loads with ``AutoModelForCausalLM`` (``Qwen3_5(Moe)ForCausalLM``,
also for VLM checkpoints); ``"conditional_generation"`` loads the whole
``Qwen3_5(Moe)ForConditionalGeneration`` (VLM checkpoints only).
"""

TokenIds = torch.Tensor | Sequence[Sequence[int]]
"""A batch of token ids, ``[N, S]``; prompts for generation may differ in length."""

DEFAULT_TIMEOUT_S: Final = 1800.0
"""Turns a hung reference into a failure, with room for the test machines'
slow hours (``recipe_runner.TIMEOUT_S``)."""

_WORKER_PATH: Final = Path(__file__).with_name("_worker.py")

# Most of a traceback's value is at its end; transformers' warnings come first.
_MAX_STDERR_CHARS: Final = 20_000

T = TypeVar("T")


class HfReferenceError(RuntimeError):
    """Raised when the reference subprocess fails; the message holds its stderr."""


@final
class Pending(Generic[T]):
    """The result of a request in an :class:`HfReferenceBatch`, set when the batch runs."""

    def __init__(self) -> None:
        self._value: T | None = None
        self._is_set = False

    def result(self) -> T:
        if not self._is_set:
            raise RuntimeError("The batch holding this request has not run yet. Call `HfReferenceBatch.run()` first.")

        return self._value  # type: ignore[return-value]

    def _set(self, value: T) -> None:
        self._value = value
        self._is_set = True


def _as_rows(name: str, ids: TokenIds, *, ragged: bool = False) -> list[list[int]]:
    rows = ids.tolist() if isinstance(ids, torch.Tensor) else [list(row) for row in ids]

    if not rows or not all(isinstance(row, list) and row and all(isinstance(i, int) for i in row) for row in rows):
        raise ValueError(f"`{name}` must be a non-empty batch of non-empty rows of token ids.")

    if not ragged and any(len(row) != len(rows[0]) for row in rows):
        raise ValueError(f"`{name}` must be a rectangular batch of token ids of shape [N, S].")

    return rows


@final
class _ReferenceServer:
    """A reference subprocess serving the batches of one test process.

    Each batch is a line on its stdin (the path of the batch's document),
    answered by the line ``done`` on its stdout once the results are written.
    Its stderr goes to a file, of which a failed batch's error holds the part
    written during that batch. A failed or timed-out batch ends the
    subprocess; the next batch starts a new one.
    """

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

        self.owner_pid = os.getpid()

        self._stderr = tempfile.TemporaryFile(prefix="qwen35-hf-reference-stderr-")

        # -P: keep this package's directory off the worker's sys.path.
        self._process = subprocess.Popen(
            [sys.executable, "-P", str(_WORKER_PATH)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )

        atexit.register(self.close)

    @property
    def pid(self) -> int:
        return self._process.pid

    def is_running(self) -> bool:
        return self._process.poll() is None

    def run(self, request_path: Path, kinds: str, timeout_s: float) -> None:
        """Runs the batch of ``request_path``, whose requests are ``kinds``.

        :raises HfReferenceError: if the subprocess fails or does not answer within ``timeout_s``.
        """
        assert self._process.stdin is not None and self._process.stdout is not None

        stderr_start = os.fstat(self._stderr.fileno()).st_size

        deadline = time.monotonic() + timeout_s

        answer = b""

        try:
            self._process.stdin.write(f"{request_path}\n".encode())

            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # It has exited; the read below sees the end of its stdout.

        while not answer.endswith(b"\n"):
            remaining = deadline - time.monotonic()

            if remaining <= 0:
                self._process.kill()

                self._process.wait()

                raise HfReferenceError(
                    f"The HF reference subprocess ({kinds}) did not finish within {timeout_s} s. "
                    f"stderr:\n{self._stderr_since(stderr_start)}"
                )

            ready, _, _ = select.select([self._process.stdout], [], [], remaining)

            if not ready:
                continue

            chunk = os.read(self._process.stdout.fileno(), 64)

            if not chunk:
                returncode = self._process.wait()

                raise HfReferenceError(
                    f"The HF reference subprocess ({kinds}) failed with exit code {returncode}. "
                    f"stderr:\n{self._stderr_since(stderr_start)}"
                )

            answer += chunk

        if answer != b"done\n":
            self._process.kill()

            self._process.wait()

            raise HfReferenceError(f"The HF reference subprocess ({kinds}) must answer 'done', but answered {answer!r} instead.")

    def _stderr_since(self, start: int) -> str:
        end = os.fstat(self._stderr.fileno()).st_size

        start = max(start, end - 4 * _MAX_STDERR_CHARS)

        return os.pread(self._stderr.fileno(), end - start, start).decode(errors="replace")[-_MAX_STDERR_CHARS:]

    def close(self) -> None:
        """Ends the subprocess (closing its stdin ends its loop) and drops its stderr file."""
        if self.owner_pid != os.getpid():
            return

        if self._process.stdin is not None and not self._process.stdin.closed:
            try:
                self._process.stdin.close()
            except BrokenPipeError:
                pass

        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()

            self._process.wait()

        if self._process.stdout is not None:
            self._process.stdout.close()

        self._stderr.close()


_server: _ReferenceServer | None = None


def _reference_server(env: dict[str, str]) -> _ReferenceServer:
    """This process's reference subprocess, started anew if it has exited or
    the environment a batch would give it has changed since it started."""
    global _server

    if _server is not None and (_server.owner_pid != os.getpid() or _server.env != env or not _server.is_running()):
        end_hf_reference_subprocess()

    if _server is None:
        _server = _ReferenceServer(env)

    return _server


def end_hf_reference_subprocess() -> None:
    """Ends this process's reference subprocess, if it has one; the next batch starts another."""
    global _server

    if _server is not None:
        _server.close()

        _server = None


@final
class HfReferenceBatch:
    """Collects reference requests and runs them in one subprocess.

    Requests run in the order they were added, so a model built by a batch can
    be used by its later requests; a model directory is loaded once per batch.
    """

    def __init__(self) -> None:
        self._requests: list[dict[str, Any]] = []
        self._consumers: list[Callable[[dict[str, Any], Path], None]] = []

    def make_tiny_model(self, out_dir: Path | str, spec: TinyQwen35Spec) -> Path:
        """Adds a build of a tiny random checkpoint; returns its directory (filled when the batch runs)."""
        out_dir = Path(out_dir).resolve()

        self._add({"kind": "build", "out_dir": str(out_dir), "spec": spec.to_json()}, lambda result, work_dir: None)

        return out_dir

    def logits(
        self,
        model_dir: Path | str,
        input_ids: TokenIds,
        *,
        attention_mask: TokenIds | None = None,
        model_class: ModelClass = "auto",
        precision: ReferencePrecision = "float32",
        adapter_dir: Path | str | None = None,
    ) -> Pending[torch.Tensor]:
        """Adds a forward pass in eval mode; its result is the logits, ``[N, S, V]``, cast to fp32.

        :param attention_mask: ``[N, S]``, 1 for tokens and 0 for right padding.
        :param precision: The dtype the model is loaded in, or bf16 autocast over fp32 weights.
        :param adapter_dir: A PEFT adapter directory to load onto the model with
            ``PeftModel.from_pretrained``; every tensor of it must load into the model.
        """
        pending: Pending[torch.Tensor] = Pending()

        def consume(result: dict[str, Any], work_dir: Path) -> None:
            pending._set(load_file(work_dir / result["path"])["logits"].clone())

        rows = _as_rows("input_ids", input_ids)

        mask_rows = None if attention_mask is None else _as_rows("attention_mask", attention_mask)

        if mask_rows is not None and [len(r) for r in mask_rows] != [len(r) for r in rows]:
            raise ValueError(
                f"`attention_mask` must have the shape of `input_ids` ({len(rows)}, {len(rows[0])}), "
                f"but has ({len(mask_rows)}, {len(mask_rows[0])}) instead."
            )

        request = {
            "kind": "logits",
            "model_dir": str(Path(model_dir).resolve()),
            "model_class": model_class,
            "input_ids": rows,
            "attention_mask": mask_rows,
            "precision": precision,
            "adapter_dir": None if adapter_dir is None else str(Path(adapter_dir).resolve()),
        }

        self._add(request, consume)

        return pending

    def greedy_generate(
        self,
        model_dir: Path | str,
        prompt_ids: TokenIds,
        max_new_tokens: int,
        *,
        eos_token_id: int | None = None,
        model_class: ModelClass = "auto",
    ) -> Pending[list[list[int]]]:
        """Adds greedy decoding of each prompt on its own; its result is the new tokens of each prompt.

        Without ``eos_token_id`` every prompt gets exactly ``max_new_tokens`` tokens.
        """
        pending: Pending[list[list[int]]] = Pending()

        request = {
            "kind": "generate",
            "model_dir": str(Path(model_dir).resolve()),
            "model_class": model_class,
            "prompts": _as_rows("prompt_ids", prompt_ids, ragged=True),
            "max_new_tokens": max_new_tokens,
            "eos_token_id": eos_token_id,
        }

        self._add(request, lambda result, work_dir: pending._set(result["tokens"]))

        return pending

    def _add(self, request: dict[str, Any], consume: Callable[[dict[str, Any], Path], None]) -> None:
        self._requests.append(request)
        self._consumers.append(consume)

    def run(self, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Runs all requests in this process's reference subprocess and sets their results.

        :raises HfReferenceUnavailableError: if the overlay is missing and cannot be installed.
        :raises HfReferenceError: if the subprocess fails or times out.
        """
        if not self._requests:
            return

        overlay_dir = ensure_hf_reference()

        # pytest names the running test in PYTEST_CURRENT_TEST: the reference
        # has no use for it, and it would restart the subprocess at each test.
        env = {name: value for name, value in os.environ.items() if name != "PYTEST_CURRENT_TEST"}

        env.update({
            "PYTHONPATH": str(overlay_dir),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        })  # fmt: skip

        kinds = ", ".join(request["kind"] for request in self._requests)

        with tempfile.TemporaryDirectory(prefix="qwen35-hf-reference-") as tmp:
            work_dir = Path(tmp)

            request_path = work_dir / "request.json"

            request_path.write_text(json.dumps({"work_dir": str(work_dir), "requests": self._requests}))

            _reference_server(env).run(request_path, kinds, timeout_s)

            results = json.loads((work_dir / "results.json").read_text())

            for consume, result in zip(self._consumers, results, strict=True):
                consume(result, work_dir)

        self._requests = []
        self._consumers = []


def make_tiny_hf_model(out_dir: Path | str, spec: TinyQwen35Spec) -> Path:
    """Builds a tiny random Qwen3.5 checkpoint (safetensors + config.json) with the HF reference."""
    batch = HfReferenceBatch()

    model_dir = batch.make_tiny_model(out_dir, spec)

    batch.run()

    return model_dir


def hf_logits(
    model_dir: Path | str,
    input_ids: TokenIds,
    *,
    attention_mask: TokenIds | None = None,
    model_class: ModelClass = "auto",
) -> torch.Tensor:
    """Returns the HF reference's fp32 logits, ``[N, S, V]``, for ``input_ids`` (``[N, S]``)."""
    batch = HfReferenceBatch()

    logits = batch.logits(model_dir, input_ids, attention_mask=attention_mask, model_class=model_class)

    batch.run()

    return logits.result()


def hf_greedy_generate(
    model_dir: Path | str,
    prompt_ids: TokenIds,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    model_class: ModelClass = "auto",
) -> list[list[int]]:
    """Returns the tokens the HF reference generates greedily after each prompt (prompt excluded)."""
    batch = HfReferenceBatch()

    tokens = batch.greedy_generate(
        model_dir, prompt_ids, max_new_tokens, eos_token_id=eos_token_id, model_class=model_class
    )

    batch.run()

    return tokens.result()
