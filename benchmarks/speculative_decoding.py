"""Measures greedy decoding with MTP speculative decoding against plain
greedy decoding (:class:`qwen35_fs2.recipes.speculative.GreedyDecoder`), in
the same run, on CPU.

The speed-up of speculative decoding depends on how often the trunk accepts
the head's drafts, which depends on trained weights this benchmark does not
have. It therefore decodes with two heads of the same random model:

- ``random``: the head as initialised; its drafts are almost never accepted,
  the worst case (every draft costs a pass over it, a restore and the pass
  plain decoding makes);
- ``echo``: a head built to draft the trunk's own next token (``fc`` passes
  the trunk's output through, its layer's residual branches scaled by 0.1),
  accepted wherever the trunk repeats a token, which a random model often
  does: a high-acceptance case.

For each: tokens per second of plain and speculative decoding, the
acceptance, the trunk passes per token, and the ``ideal`` tokens per second
at that acceptance (the floor of the time: a verifying pass costing what a
one-token pass costs, drafting and restoring free, so ``1 + acceptance``
tokens per plain pass). The responses of both decodings must be equal; the
benchmark fails otherwise.

Prints one JSON object. Example (the Qwen3.5-0.8B shapes with 4 of its 24
layers, 2 threads)::

    .venv/bin/python benchmarks/speculative_decoding.py --arch qwen35_0.8b --num-layers 4 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fairseq2.data.tokenizers import VocabularyInfo
from fairseq2.gang import create_fake_gangs, set_gangs
from fairseq2.models.transformer_lm import TransformerLM

from qwen35_fs2.models.qwen35 import create_qwen35_model, get_qwen35_model_hub
from qwen35_fs2.nn.mtp import Qwen35MultiTokenPredictor, find_mtp
from qwen35_fs2.recipes.speculative import DecodingOutput, GreedyDecoder

from train_step import cpu_model


def _make_model(args: argparse.Namespace) -> TransformerLM:
    config = get_qwen35_model_hub().get_arch_config(args.arch)

    config.mtp_num_layers = 1

    if args.num_layers is not None:
        config.num_layers = args.num_layers

    torch.manual_seed(args.seed)

    with set_gangs(create_fake_gangs(torch.device("cpu"))):
        model = create_qwen35_model(config)

    return model.eval()


def _make_echo_head(mtp: Qwen35MultiTokenPredictor) -> None:
    model_dim = mtp.fc.output_dim

    with torch.no_grad():
        mtp.fc.weight.copy_(torch.cat([torch.zeros(model_dim, model_dim), torch.eye(model_dim)], dim=1))

        for name, param in mtp.layers.named_parameters():
            if name.endswith("output_proj.weight"):
                param.mul_(0.1)


def _decode(decoder: GreedyDecoder, prompts: list[torch.Tensor]) -> dict[str, object]:
    plain_outputs: list[DecodingOutput] = []
    speculative_outputs: list[DecodingOutput] = []

    for prompt in prompts:
        # Alternated, so that both see the same machine load.
        plain_outputs.append(decoder.plain(prompt))

        speculative_outputs.append(decoder.speculative(prompt))

    for plain, speculative in zip(plain_outputs, speculative_outputs):
        if not torch.equal(plain.tokens, speculative.tokens):
            raise RuntimeError("Speculative decoding gave other tokens than plain decoding.")

    num_tokens = sum(o.tokens.numel() for o in plain_outputs)

    plain_time = sum(o.elapsed_time for o in plain_outputs)
    speculative_time = sum(o.elapsed_time for o in speculative_outputs)

    num_drafts = sum(o.num_drafts for o in speculative_outputs)
    num_accepted = sum(o.num_accepted for o in speculative_outputs)

    acceptance = num_accepted / max(num_drafts, 1)

    plain_tps = num_tokens / plain_time

    return {
        "num_tokens": num_tokens,
        "acceptance": acceptance,
        "plain_tokens_per_second": plain_tps,
        "speculative_tokens_per_second": num_tokens / speculative_time,
        "ideal_tokens_per_second": plain_tps * (1.0 + acceptance),
        "speedup": plain_time / speculative_time,
        "trunk_passes_per_token": sum(o.num_trunk_passes for o in speculative_outputs) / num_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    parser.add_argument("--arch", default="qwen35_0.8b", help="a Qwen3.5 architecture (default: %(default)s)")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer layers than the architecture's")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 48], help="(default: %(default)s)")
    parser.add_argument("--max-gen-len", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)

    args = parser.parse_args()

    torch.set_num_threads(args.threads)

    model = _make_model(args)

    mtp = find_mtp(model)

    if mtp is None:
        raise RuntimeError("The model has no MTP head.")

    vocab_size = model.final_proj.output_dim

    # An end-of-sequence token the random model does not favour; no pad.
    vocab_info = VocabularyInfo(size=vocab_size, unk_idx=None, bos_idx=None, eos_idx=vocab_size - 1, pad_idx=None)

    decoder = GreedyDecoder(model, vocab_info, max_gen_len=args.max_gen_len, mtp=mtp)

    generator = torch.Generator().manual_seed(args.seed)

    prompts = [torch.randint(0, vocab_size - 1, (n,), generator=generator) for n in args.prompt_lens]

    # Warm-up: allocations and the first calls of every kernel.
    decoder.plain(prompts[0][:4])
    decoder.speculative(prompts[0][:4])

    results = {"random": _decode(decoder, prompts)}

    _make_echo_head(mtp)

    results["echo"] = _decode(decoder, prompts)

    report = {
        "benchmark": "speculative_decoding",
        "command": " ".join(sys.argv),
        "cpu": cpu_model(),
        "threads": args.threads,
        "arch": args.arch,
        "num_layers": len(model.decoder.layers),  # type: ignore[arg-type]
        "model_dim": mtp.fc.output_dim,
        "vocab_size": vocab_size,
        "prompt_lens": args.prompt_lens,
        "max_gen_len": args.max_gen_len,
        "heads": results,
    }

    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
