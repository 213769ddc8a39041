"""Serves Qwen3.5 reference requests from inside the transformers 5.x overlay.

The test process runs transformers 4.57 (fairseq2's pin), which has no Qwen3.5,
so this script runs in a subprocess whose ``PYTHONPATH`` is the overlay. It must
not import anything from this repository. It serves batches until its stdin
closes: each line of stdin is the path of a JSON document holding a list of
requests; it runs them in order, writes ``results.json`` (and one safetensors
file per logits request) to the ``work_dir`` the document names, and answers
with the line ``done`` on its stdout, which carries nothing else. A failure
exits non-zero with a traceback on stderr, which the caller puts into its
exception.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

# transformers 5.x uses fla / causal_conv1d whenever they are importable, even
# on CPU where their Triton and CUDA kernels fail. A ``None`` entry makes every
# import of them (and of their submodules) raise ``ImportError``, so the pure
# PyTorch reference paths run. This must happen before transformers is imported.
for _name in ("fla", "causal_conv1d"):
    sys.modules[_name] = None  # type: ignore[assignment]

# The imports below make about 300,000 objects, which the cyclic garbage
# collector would traverse again and again while they are made, and once more
# at the subprocess's end: about 2.5 of the 10 s of CPU a subprocess with one
# small build and one forward pass took, and a test process starts one for
# each module that uses the reference (docs/performance.md, "Where the
# suite's CPU goes, and the reference's subprocess"). So they run with the
# collector off, and what they made is frozen (`gc.freeze()`: never traversed
# again) before it is back on.
gc.disable()

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

# Imported by name so that type checkers, which see the test environment's
# transformers 4.57, do not check it against the overlay's 5.x API.
transformers = importlib.import_module("transformers")

# transformers imports its model modules on first use; the ones the requests
# go through (the auto classes, Qwen3.5 dense and MoE) are imported now, to be
# frozen with the rest.
for _module in (
    "transformers.models.auto.modeling_auto",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
):
    importlib.import_module(_module)

gc.collect()
gc.freeze()
gc.enable()

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

_SAFETENSORS_NAME = "model.safetensors"

_ZERO_CENTRED_NORMS = frozenset({"Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"})
_GATED_NORMS = frozenset({"Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated"})
_GATED_DELTA_NETS = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})

# Tiny vision tower: only there so the VLM layout has real ``model.visual.*``
# keys next to the language model; the text-only tests never run it.
_TINY_VISION_CONFIG: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 16,
}


def _mrope_section(rotary_dim: int) -> list[int]:
    """Splits the rotary frequencies over (T, H, W) as the released [11, 11, 10] does."""
    num_freqs = rotary_dim // 2

    base, rest = divmod(num_freqs, 3)

    return [base + int(rest > 0), base + int(rest > 1), base]


def _text_config_dict(spec: dict[str, Any]) -> dict[str, Any]:
    rotary_dim = int(spec["head_dim"] * spec["partial_rotary_factor"])

    config: dict[str, Any] = {
        "vocab_size": spec["vocab_size"],
        "hidden_size": spec["hidden_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "head_dim": spec["head_dim"],
        "linear_num_key_heads": spec["linear_num_key_heads"],
        "linear_num_value_heads": spec["linear_num_value_heads"],
        "linear_key_head_dim": spec["linear_key_head_dim"],
        "linear_value_head_dim": spec["linear_value_head_dim"],
        "linear_conv_kernel_dim": spec["linear_conv_kernel_dim"],
        "rms_norm_eps": spec["rms_norm_eps"],
        "initializer_range": spec["initializer_range"],
        "tie_word_embeddings": spec["tie_word_embeddings"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec["rope_theta"],
            "partial_rotary_factor": spec["partial_rotary_factor"],
            "mrope_section": _mrope_section(rotary_dim),
            "mrope_interleaved": True,
        },
    }

    if spec["layer_types"] is not None:
        config["layer_types"] = list(spec["layer_types"])
    else:
        config["full_attention_interval"] = spec["full_attention_interval"]

    if spec["moe"]:
        config["num_experts"] = spec["num_experts"]
        config["num_experts_per_tok"] = spec["num_experts_per_tok"]
        config["moe_intermediate_size"] = spec["moe_intermediate_size"]
        config["shared_expert_intermediate_size"] = spec["shared_expert_intermediate_size"]
    else:
        config["intermediate_size"] = spec["intermediate_size"]

    return config


def _class_prefix(spec: dict[str, Any]) -> str:
    return "Qwen3_5Moe" if spec["moe"] else "Qwen3_5"


def _create_text_model(spec: dict[str, Any], text_config: dict[str, Any]) -> Any:
    config = getattr(transformers, f"{_class_prefix(spec)}TextConfig")(**text_config)

    return getattr(transformers, f"{_class_prefix(spec)}ForCausalLM")(config)


def _wrap_in_vlm(spec: dict[str, Any], text_config: dict[str, Any], text_model: Any) -> Any:
    """Puts ``text_model``'s weights into a VLM, so that both layouts of a spec hold the same language model."""
    vision_config = dict(_TINY_VISION_CONFIG, out_hidden_size=spec["hidden_size"])

    config = getattr(transformers, f"{_class_prefix(spec)}Config")(
        text_config=text_config,
        vision_config=vision_config,
        tie_word_embeddings=spec["tie_word_embeddings"],
    )

    model = getattr(transformers, f"{_class_prefix(spec)}ForConditionalGeneration")(config)

    model.model.language_model.load_state_dict(text_model.model.state_dict())

    model.lm_head.load_state_dict(text_model.lm_head.state_dict())

    return model


@torch.no_grad()
def _randomize_untrained_parameters(model: Any, generator: torch.Generator) -> None:
    """Gives every parameter HF initialises to a constant a random value.

    HF sets the zero-centred RMSNorms to 0 (scale 1), the gated norm to 1 and
    ``dt_bias`` to 1; left that way, a wrong ``1 + w`` or a swapped norm would
    go unnoticed by parity tests.
    """

    def randn(like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, generator=generator, dtype=like.dtype)

    def uniform(like: torch.Tensor, low: float, high: float) -> torch.Tensor:
        return torch.rand(like.shape, generator=generator, dtype=like.dtype) * (high - low) + low

    for module in model.modules():
        kind = type(module).__name__

        if kind in _ZERO_CENTRED_NORMS:
            module.weight.copy_(0.1 * randn(module.weight))
        elif kind in _GATED_NORMS:
            module.weight.copy_(1.0 + 0.1 * randn(module.weight))
        elif kind in _GATED_DELTA_NETS:
            # Decay rates A in [0.01, 16], as HF samples them.
            module.A_log.copy_(uniform(module.A_log, 0.01, 16.0).log())

            # Mamba-style time steps, log-uniform in [1e-3, 1e-1], stored
            # through the inverse softplus, so decays range from fast to slow.
            dt = uniform(module.dt_bias, math.log(1e-3), math.log(1e-1)).exp()

            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def _state_dict(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def _mtp_state_dict(spec: dict[str, Any], text_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Builds the released checkpoints' top-level ``mtp.*`` tensors, which HF neither models nor saves.

    The MTP layer is one full-attention decoder layer; it is taken from a
    one-layer HF text model so that it has HF's parameter names and shapes.
    """
    generator = torch.Generator().manual_seed(spec["seed"] + 1)

    torch.manual_seed(spec["seed"] + 1)

    layer_config = dict(text_config, num_hidden_layers=1, layer_types=["full_attention"])

    layer_config.pop("full_attention_interval", None)

    layer_model = _create_text_model(spec, layer_config)

    _randomize_untrained_parameters(layer_model, generator)

    hidden_size = spec["hidden_size"]

    mtp = {
        "mtp.fc.weight": spec["initializer_range"] * torch.randn(hidden_size, 2 * hidden_size, generator=generator),
    }

    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = 0.1 * torch.randn(hidden_size, generator=generator)

    layer_prefix = "model.layers.0."

    for key, value in _state_dict(layer_model).items():
        if key.startswith(layer_prefix):
            mtp["mtp.layers.0." + key[len(layer_prefix) :]] = value

    return mtp


def _lay_out_experts(state_dict: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Writes the fused 3-D expert tensors in ``layout``.

    transformers 5.24's ``save_pretrained`` converts HF's in-memory fused
    ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` to
    per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``, while released
    checkpoints store the fused form, so both are produced from memory here.
    """
    output: dict[str, torch.Tensor] = {}

    for key, value in state_dict.items():
        if layout == "fused" or not key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            output[key] = value
        elif key.endswith(".gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")

            for expert_idx, gate_up in enumerate(value):
                gate, up = gate_up.chunk(2, dim=0)

                output[f"{prefix}{expert_idx}.gate_proj.weight"] = gate.contiguous()
                output[f"{prefix}{expert_idx}.up_proj.weight"] = up.contiguous()
        else:
            prefix = key.removesuffix("down_proj")

            for expert_idx, down in enumerate(value):
                output[f"{prefix}{expert_idx}.down_proj.weight"] = down.contiguous()

    return output


def _build(request: dict[str, Any]) -> dict[str, Any]:
    spec = request["spec"]

    out_dir = Path(request["out_dir"])

    dtype = getattr(torch, spec["dtype"])

    text_config = _text_config_dict(spec)

    torch.manual_seed(spec["seed"])

    model = _create_text_model(spec, text_config)

    _randomize_untrained_parameters(model, torch.Generator().manual_seed(spec["seed"]))

    if spec["layout"] == "vlm":
        model = _wrap_in_vlm(spec, text_config, model)

    model.to(dtype)

    model.save_pretrained(out_dir)

    if (out_dir / f"{_SAFETENSORS_NAME}.index.json").exists():
        raise RuntimeError(f"{out_dir} holds a sharded checkpoint, but the tiny models must fit in one shard.")

    # Rewrite the tensors from memory: the experts in the requested layout and
    # the MTP head, keeping the key names ``save_pretrained`` chose.
    saved = load_file(out_dir / _SAFETENSORS_NAME)

    in_memory = _state_dict(model)

    tensors = {k: v for k, v in saved.items() if ".mlp.experts." not in k}

    for key, value in in_memory.items():
        if ".mlp.experts." in key:
            tensors[key] = value

    if spec["add_mtp"]:
        tensors.update({k: v.to(dtype) for k, v in _mtp_state_dict(spec, text_config).items()})

    tensors = _lay_out_experts(tensors, spec["expert_layout"])

    if spec["expert_layout"] == "per_expert":
        rewritten_keys = {k for k in tensors if not k.startswith("mtp.")}

        if rewritten_keys != saved.keys():
            raise RuntimeError(
                "The per-expert rewrite must reproduce the keys `save_pretrained` wrote, but does not. "
                f"Only rewritten: {sorted(rewritten_keys - saved.keys())}; "
                f"only saved: {sorted(saved.keys() - rewritten_keys)}."
            )

    save_file(tensors, out_dir / _SAFETENSORS_NAME, metadata={"format": "pt"})

    return {"model_dir": str(out_dir)}


def _load_peft_adapter(model: Any, adapter_dir: str) -> Any:
    """Loads the PEFT adapter of ``adapter_dir`` onto ``model``, failing
    unless every tensor of the adapter ends up in the model: PEFT itself
    only warns about keys it cannot place."""
    peft = importlib.import_module("peft")

    model = peft.PeftModel.from_pretrained(model, adapter_dir)

    saved = load_file(Path(adapter_dir) / "adapter_model.safetensors")

    loaded = peft.get_peft_model_state_dict(model)

    if saved.keys() != loaded.keys():
        raise RuntimeError(
            f"The adapter's keys must be the model's adapter keys, but are not. "
            f"Only in the adapter: {sorted(saved.keys() - loaded.keys())}; only in the model: {sorted(loaded.keys() - saved.keys())}."
        )

    for key, value in saved.items():
        if not torch.equal(loaded[key].to(value.dtype), value):
            raise RuntimeError(f"`{key}` must load unchanged into the model, but does not.")

    return model


class _ModelCache:
    """Keeps loaded models so that several requests on one directory load it once."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str, str, str | None], Any] = {}

    def get(self, model_dir: str, model_class: str, dtype: str = "float32", adapter_dir: str | None = None) -> Any:
        key = (model_dir, model_class, dtype, adapter_dir)

        model = self._models.get(key)
        if model is None:
            # Otherwise from_pretrained takes the path for a Hub repository id.
            if not (Path(model_dir) / "config.json").is_file():
                raise FileNotFoundError(f"{model_dir} must be a checkpoint directory with a config.json, but is not.")

            if model_class == "conditional_generation":
                auto_class = transformers.AutoModelForImageTextToText
            else:
                auto_class = transformers.AutoModelForCausalLM

            model = auto_class.from_pretrained(model_dir, dtype=getattr(torch, dtype))

            if adapter_dir is not None:
                model = _load_peft_adapter(model, adapter_dir)

            model = model.eval()

            self._models[key] = model

        return model

    def forget(self, model_dir: str) -> None:
        """Drops models of ``model_dir``, which a build request has just (re)written."""
        self._models = {k: v for k, v in self._models.items() if k[0] != model_dir}


@torch.no_grad()
def _logits(request: dict[str, Any], models: _ModelCache, work_dir: Path, index: int) -> dict[str, Any]:
    precision = request["precision"]

    autocast = precision == "autocast_bfloat16"

    dtype = "float32" if autocast else precision

    model = models.get(request["model_dir"], request["model_class"], dtype, request["adapter_dir"])

    input_ids = torch.tensor(request["input_ids"], dtype=torch.int64)

    attention_mask = request["attention_mask"]
    if attention_mask is not None:
        attention_mask = torch.tensor(attention_mask, dtype=torch.int64)

    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    name = f"logits_{index}.safetensors"

    save_file({"logits": logits.float().contiguous()}, work_dir / name)

    return {"path": name}


@torch.no_grad()
def _generate(request: dict[str, Any], models: _ModelCache) -> dict[str, Any]:
    model = models.get(request["model_dir"], request["model_class"])

    max_new_tokens = request["max_new_tokens"]

    # generate() fills the unset fields of the config it is given from the
    # checkpoint's generation_config.json (eos ids, sampling); replacing the
    # loaded one with the library defaults makes the request alone decide.
    model.generation_config = transformers.GenerationConfig()

    generation_config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=request["eos_token_id"],
        pad_token_id=request["eos_token_id"],
    )

    # One prompt at a time: a padded batch would test HF's padding handling
    # rather than the model.
    outputs = []

    for prompt in request["prompts"]:
        prompt_ids = torch.tensor([prompt], dtype=torch.int64)

        sequences = model.generate(
            input_ids=prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            generation_config=generation_config,
        )

        outputs.append(sequences[0, len(prompt) :].tolist())

    return {"tokens": outputs}


def _run_batch(document_path: Path) -> None:
    document = json.loads(document_path.read_text())

    work_dir = Path(document["work_dir"])

    # One batch's models only: a later batch may rebuild a directory.
    models = _ModelCache()

    results = []

    for index, request in enumerate(document["requests"]):
        kind = request["kind"]

        if kind == "build":
            models.forget(request["out_dir"])

            results.append(_build(request))
        elif kind == "logits":
            results.append(_logits(request, models, work_dir, index))
        elif kind == "generate":
            results.append(_generate(request, models))
        else:
            raise ValueError(f"`kind` must be 'build', 'logits' or 'generate', but is '{kind}' instead.")

    (work_dir / "results.json").write_text(json.dumps(results))


def main() -> None:
    # The answers get their own copy of fd 1, and fd 1 becomes stderr, so that
    # nothing a library prints can be taken for an answer.
    answers = os.fdopen(os.dup(1), "wb", buffering=0)

    os.dup2(2, 1)

    for line in sys.stdin.buffer:
        _run_batch(Path(line.decode().strip()))

        gc.collect()

        answers.write(b"done\n")


if __name__ == "__main__":
    main()
