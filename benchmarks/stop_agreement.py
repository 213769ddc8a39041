"""Measures what the stop-on-signal workaround adds to every training step:
the ranks' agreement on whether any of them was asked to stop
(:mod:`qwen35_fs2.compat.stop_on_signal`), on CPU processes.

Variants, each over ``--world-size`` processes of one ``torchrun``-like
group (gloo, as CPU training uses), the same number of timed calls:

- ``ours``: the workaround's agreement, one all-reduce of a single number
  read on the host;
- ``floor``: the same loop without it (what fairseq2's own post-step check
  costs: reading a flag).

Prints one JSON line with the microseconds per step of each, the median over
the ranks of rank-local means. Compare with a step of
``benchmarks/train_step.py``. Example::

    .venv/bin/python benchmarks/stop_agreement.py --world-size 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from types import SimpleNamespace

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))

        port: int = sock.getsockname()[1]

        return port


def _worker(rank: int, args: argparse.Namespace, port: int, results: dict[int, dict[str, float]]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(rank)
    )

    import torch

    from fairseq2.gang import ProcessGroupGang

    torch.set_num_threads(1)

    gang = ProcessGroupGang.create_default_process_group(torch.device("cpu"))

    from qwen35_fs2.compat.stop_on_signal import stop_on_signal

    # The state the agreement reads; fairseq2's own post step is left out of
    # both variants.
    trainer = SimpleNamespace(
        _max_num_steps=None, _step_nr=1, _stop_requested=False, _gangs=SimpleNamespace(root=gang), _run_post_step=lambda: None
    )

    stop_on_signal(trainer)  # type: ignore[arg-type]

    agreement = trainer._run_post_step

    def floor() -> None:
        if trainer._stop_requested:
            raise RuntimeError("No stop is requested.")

    timings = {}

    for name, step in (("floor", floor), ("ours", agreement)):
        for _ in range(args.num_warmup):
            step()

        gang.barrier()

        start = time.perf_counter()

        for _ in range(args.num_steps):
            step()

        timings[f"{name}_us_per_step"] = (time.perf_counter() - start) / args.num_steps * 1e6

    results[rank] = timings

    gang.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--num-steps", type=int, default=2000)
    parser.add_argument("--num-warmup", type=int, default=200)

    args = parser.parse_args()

    manager = mp.Manager()

    results = manager.dict()

    mp.start_processes(_worker, args=(args, _free_port(), results), nprocs=args.world_size, start_method="spawn")

    report = {
        "world_size": args.world_size,
        "num_steps": args.num_steps,
        **{key: round(statistics.median(r[key] for r in results.values()), 1) for key in ("ours_us_per_step", "floor_us_per_step")},
    }

    json.dump(report, sys.stdout)

    print()


if __name__ == "__main__":
    main()
