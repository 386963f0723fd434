"""What replicas buy: one engine against N behind the router, on the same offline workload (by default the
256-sequence workload: prompts and outputs of 100 to 1,024 tokens), as output tokens per second, with how
the router spread the requests.

    .venv/bin/python step04_multi_gpu/bench/bench_replicas.py --model tiny-qwen3 --workload fixed --batch 16  # CPU, quick
    python step04_multi_gpu/bench/bench_replicas.py --device cuda --model random:qwen3-0.6b --sizes 1,2       # two GPUs
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from common.bench import Workload, default_output, evidence_header, fixed_workload, nanovllm_workload, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_sizes
from common.config import EMBEDDED_MODEL
from common.sampling import SamplingParams
from common.steps import STEP_NAMES, find_step


def run_workload(engine: Any, workload: Workload) -> tuple[float, int]:
    """Seconds to answer every request of the workload, all added at once, and the tokens generated."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    completions = engine.generate(workload.prompts, params)
    return time.perf_counter() - start, sum(len(c.token_ids) for c in completions)


def routed(engine: Any, size: int) -> list[float]:
    """Requests the router has sent to each replica so far (one engine: none counted)."""
    stats = engine.stats()
    return [stats.get(f"replica{i}_requests_routed_total", 0) for i in range(size)]


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--step", default=STEP_NAMES[-1], choices=STEP_NAMES)
    p.add_argument("--sizes", default="1,2", help="replica counts to compare, 1 first (default 1,2)")
    p.add_argument("--workload", choices=["nanovllm", "fixed"], default="nanovllm")
    p.add_argument("--batch", type=int, default=16, help="--workload fixed: requests (default 16)")
    p.add_argument("--max-tokens", type=at_least(1), default=64, help="--workload fixed: new tokens each (default 64)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    try:
        check_args(args)
        sizes = parse_sizes("--sizes", args.sizes)
        if sizes[0] != 1:
            raise CommandLineError("--sizes must start with 1: every count is compared with one engine")
    except CommandLineError as err:
        return fail(err)
    from step04_multi_gpu.replicas import ReplicatedEngine

    workload = (nanovllm_workload() if args.workload == "nanovllm"
                else fixed_workload(args.batch, 32, args.max_tokens))
    engine_class = find_step(args.step).engine_class()
    config = engine_class.config_class(model=args.model, device=args.device)
    rows: list[dict[str, Any]] = []
    header: dict[str, Any] = {}
    for size in sizes:
        engine = engine_class.from_config(config) if size == 1 else ReplicatedEngine(args.step, config, size)
        if not header:
            header = evidence_header(engine.model.device, args.model, engine.model.dtype,
                                     settings={"step": args.step, "sizes": sizes, "workload": workload.name})
        run_workload(engine, fixed_workload(2 * size, 16, 4))  # warm-up: every replica compiles and captures
        before = routed(engine, size)
        elapsed, tokens = run_workload(engine, workload)
        row = {"replicas": size, "requests": len(workload.prompts), "output_tokens": tokens, "elapsed_s": elapsed,
               "output_tok_per_s": tokens / elapsed}
        if size > 1:
            row["requests_routed"] = [after - earlier for after, earlier in zip(routed(engine, size), before)]
            engine.close()
        rows.append(row)
        print(f"{size} replica(s): {row['output_tok_per_s']:.1f} output tok/s"
              + (f", requests routed {row['requests_routed']}" if size > 1 else ""), flush=True)
        del engine
    for row in rows:
        row["throughput_vs_one"] = row["output_tok_per_s"] / rows[0]["output_tok_per_s"]
    write_json(args.output or default_output("step04_multi_gpu", "replicas", args.device, args.model),
               header | {"runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
