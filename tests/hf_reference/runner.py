"""Runs requests against the transformers Qwen3.5 reference in a subprocess.

Each subprocess spends about 3 s importing transformers, so requests are
collected in an :class:`HfReferenceBatch` and run by one subprocess; the
one-shot functions below are batches of one request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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

DEFAULT_TIMEOUT_S: Final = 600.0

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
        """Runs all requests in one subprocess and sets their results.

        :raises HfReferenceUnavailableError: if the overlay is missing and cannot be installed.
        :raises HfReferenceError: if the subprocess fails or times out.
        """
        if not self._requests:
            return

        overlay_dir = ensure_hf_reference()

        env = dict(os.environ)

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

            # -P: keep this package's directory off the worker's sys.path.
            command = [sys.executable, "-P", str(_WORKER_PATH), str(request_path)]

            try:
                process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired as ex:
                stderr = ex.stderr.decode(errors="replace") if isinstance(ex.stderr, bytes) else ex.stderr or ""

                raise HfReferenceError(
                    f"The HF reference subprocess ({kinds}) did not finish within {timeout_s} s. "
                    f"stderr:\n{stderr[-_MAX_STDERR_CHARS:]}"
                ) from None

            if process.returncode != 0:
                raise HfReferenceError(
                    f"The HF reference subprocess ({kinds}) failed with exit code {process.returncode}. "
                    f"stderr:\n{process.stderr[-_MAX_STDERR_CHARS:]}"
                )

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
