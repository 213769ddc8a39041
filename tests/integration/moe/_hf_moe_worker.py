"""Computes transformers 5.x's MoE load-balancing loss, run inside the overlay.

Reads a JSON request (``argv[1]``) naming a checkpoint directory, a batch and
a safetensors file of router logits; writes ``result.json`` next to it with
the model's own ``aux_loss`` (``output_router_logits=True``, so from its own
router logits) and ``load_balancing_loss_func`` applied to the given logits.
Must not import anything from this repository.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

# fla / causal_conv1d kernels fail on CPU; hide them so the PyTorch paths run.
for _name in ("fla", "causal_conv1d"):
    sys.modules[_name] = None  # type: ignore[assignment]

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

transformers = importlib.import_module("transformers")

modeling = importlib.import_module("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def main() -> None:
    request_path = Path(sys.argv[1])

    request = json.loads(request_path.read_text())

    input_ids = torch.tensor(request["input_ids"])
    attention_mask = torch.tensor(request["attention_mask"])

    model = transformers.AutoModelForCausalLM.from_pretrained(request["model_dir"], dtype=torch.float32).eval()

    config = model.config

    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True, use_cache=False)

    logits = load_file(request["router_logits"])

    given = tuple(logits[f"layer_{idx}"] for idx in range(len(logits)))

    function_loss = modeling.load_balancing_loss_func(
        given, config.num_experts, config.num_experts_per_tok, attention_mask
    )

    result = {
        "model_aux_loss": float(output.aux_loss),
        "function_aux_loss": float(function_loss),
        "num_router_outputs": len(output.router_logits),
    }

    request_path.with_name("result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
