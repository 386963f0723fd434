"""What splitting the model over ranks buys per decode step: the final engine alone and over N ranks, on the same
workload, with the all-reduces a step makes counted on rank 0 (their number and size; their time is part of the
step's). Time per output token is measured over the decode phase (once every request has its first token).

    .venv/bin/python step04_multi_gpu/bench/bench_tensor_parallel.py --sizes 1,3 --batch-sizes 1,8   # the embedded model, CPU
    python step04_multi_gpu/bench/bench_tensor_parallel.py --device cuda --model random:qwen2.5-7b --sizes 1,2 --batch-sizes 1,8,64
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from common.bench import default_output, evidence_header, fixed_workload, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_sizes
from common.config import EMBEDDED_MODEL
from common.engine import Engine
from common.sampling import SamplingParams
from common.steps import STEP_NAMES, find_step


class AllReduceCounter:
    """Counts rank 0's all-reduces, their bytes and the host's time inside them while installed (the model calls
    `dist.all_reduce`). With gloo (CPU) that time is the whole collective, waiting for the other ranks included;
    with NCCL it is only the launch, the collective itself running on the GPU."""

    def __init__(self) -> None:
        self.calls = self.bytes = 0
        self.seconds = 0.0
        self.original = dist.all_reduce

    def __enter__(self) -> AllReduceCounter:
        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            start = time.perf_counter()
            try:
                return self.original(tensor, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self.original


def decode_phase(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, int, AllReduceCounter]:
    """Seconds, steps, tokens and all-reduces of the decode phase of the prompts, all added at once."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while any(not engine.requests[i].output_token_ids for i in ids if i in engine.requests):
        engine.step()
    before = {i: len(engine.requests[i].output_token_ids) for i in ids}
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    steps, start = 0, time.perf_counter()
    with AllReduceCounter() as counter:
        while engine.has_unfinished():
            engine.step()
            steps += 1
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    return time.perf_counter() - start, steps, sum(max_tokens - n for n in before.values()), counter


def measure(engine: Engine, size: int, batches: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    decode_phase(engine, fixed_workload(2, args.prompt_len, 4).prompts, 4)  # warm-up
    rows = []
    for batch in batches:
        prompts = fixed_workload(batch, args.prompt_len, args.max_tokens, seed=batch).prompts
        elapsed, steps, tokens, counter = decode_phase(engine, prompts, args.max_tokens)
        rows.append({"tensor_parallel_size": size, "batch": batch, "elapsed_s": elapsed, "steps": steps,
                     "output_tokens": tokens, "ms_per_step": elapsed * 1e3 / steps,
                     "ms_per_output_token": elapsed * 1e3 / tokens,
                     "all_reduces_per_step": counter.calls / steps,
                     "bytes_per_all_reduce": counter.bytes / max(1, counter.calls),
                     "host_ms_in_all_reduce_per_step": counter.seconds * 1e3 / steps})
        print(f"tensor parallel {size}, batch {batch}: {rows[-1]['ms_per_step']:.2f} ms per step, "
              f"{rows[-1]['all_reduces_per_step']:.0f} all-reduces of {rows[-1]['bytes_per_all_reduce']:.0f} bytes, "
              f"{rows[-1]['host_ms_in_all_reduce_per_step']:.2f} ms in them",
              flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--step", default=STEP_NAMES[-1], choices=STEP_NAMES)
    p.add_argument("--sizes", default="1,3", help="tensor-parallel sizes to compare, 1 first (default 1,3)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=at_least(1), default=32)
    p.add_argument("--max-tokens", type=at_least(1), default=64)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    try:
        check_args(args)
        sizes, batches = parse_sizes("--sizes", args.sizes), parse_sizes("--batch-sizes", args.batch_sizes)
        if sizes[0] != 1:
            raise CommandLineError("--sizes must start with 1: every size is compared with one process")
    except CommandLineError as err:
        return fail(err)
    from step04_multi_gpu.tensor_parallel import TensorParallelEngine

    engine_class = find_step(args.step).engine_class()
    config = engine_class.config_class(model=args.model, device=args.device)
    alone = engine_class.from_config(config)
    rows = measure(alone, 1, batches, args)
    header = evidence_header(alone.model.device, args.model, alone.model.dtype,
                             settings={"step": args.step, "sizes": sizes, "batch_sizes": batches,
                                       "prompt_len": args.prompt_len, "max_tokens": args.max_tokens})
    del alone
    for size in sizes[1:]:
        with TensorParallelEngine(args.step, config, size) as engine:
            rows += measure(engine, size, batches, args)
    base = {r["batch"]: r["ms_per_output_token"] for r in rows if r["tensor_parallel_size"] == 1}
    for row in rows:
        row["time_per_token_vs_one"] = row["ms_per_output_token"] / base[row["batch"]]
    write_json(args.output or default_output("step04_multi_gpu", "tensor-parallel", args.device, args.model),
               header | {"runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
