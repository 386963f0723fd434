"""Throughput with a generous and a tight KV budget in both preemption modes, and swap bandwidth.

The workload: `--requests` requests with uneven prompts and outputs (ignore_eos), all at once. The
generous budget holds every request's worst case; the tight one holds `--tight-fraction` of the peak
that workload needs, so requests get preempted. Swap bandwidth: one request's worth of blocks (`--swap-blocks`
of every layer) swapped out and in with one gather-and-transfer per K/V, against one copy per block and
layer. Writes JSON evidence (by default runs/step07_preemption/preempt-<device>-<model>.json, ignored by git).

    .venv/bin/python step07_preemption/bench/bench_preempt.py --model random:qwen2.5-7b --device cuda
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from common.bench import Workload, default_output, evidence_header, nanovllm_workload, run_engine, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail
from common.loading import EMBEDDED_MODEL, load_model
from step07_preemption.engine import PreemptionEngine, PreemptionEngineConfig
from step07_preemption.swap import Swapper


def swap_bandwidth(engine: PreemptionEngine, num_blocks: int, per_block: bool, repeats: int = 3) -> float:
    swapper = Swapper(engine.cache, per_block=per_block)
    blocks = random.Random(0).sample(range(engine.cache.num_blocks), num_blocks)
    for _ in range(repeats):
        swapper.swap_in(swapper.swap_out(blocks), blocks)
    return swapper.stats.gb_per_s


def main() -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="auto")
    p.add_argument("--requests", type=at_least(1), default=64)
    p.add_argument("--min-len", type=at_least(1), default=100)
    p.add_argument("--max-len", type=at_least(1), default=512)
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--tight-fraction", type=float, default=0.25)
    p.add_argument("--swap-blocks", type=at_least(1), default=64)
    p.add_argument("--output", type=Path, default=None,
                   help="evidence file (default runs/step07_preemption/preempt-<device>-<model>.json)")
    args = p.parse_args()
    try:  # before the model loads: a bad value is one line and exit code 2
        check_args(args)
        if args.min_len > args.max_len:
            raise CommandLineError(f"--min-len must be at most --max-len (got {args.min_len} and {args.max_len})")
        if not 0 < args.tight_fraction <= 1:
            raise CommandLineError(f"--tight-fraction must be more than 0 and at most 1 (got {args.tight_fraction})")
    except CommandLineError as err:
        return fail(err)
    base = PreemptionEngineConfig(model=args.model, device=args.device, block_size=args.block_size)
    loaded = load_model(args.model, base.resolved_device(), base.resolved_dtype())
    workload = nanovllm_workload(args.requests, args.min_len, args.max_len)
    worst = sum(-(-(len(p) + n) // args.block_size) for p, n in zip(workload.prompts, workload.output_lens))
    longest = max(-(-(len(p) + n) // args.block_size) for p, n in zip(workload.prompts, workload.output_lens))
    budgets = {"generous": worst, "tight": max(longest, int(args.tight_fraction * worst))}
    header = evidence_header(loaded.model.device, args.model, loaded.model.dtype, workload=workload.describe(),
                             block_size=args.block_size, budgets=budgets)
    runs = []
    for budget_name, blocks in budgets.items():
        for mode in ("recompute", "swap"):
            engine = PreemptionEngine(loaded, PreemptionEngineConfig(
                model=args.model, device=args.device, block_size=args.block_size, num_blocks=blocks, preempt=mode))
            run_engine(engine, Workload("warmup", workload.prompts[:2], [4, 4]), "warmup")
            metrics = run_engine(engine, workload, f"step07-{mode}-{budget_name}")
            row = {"budget": budget_name, "num_blocks": blocks, "preempt": mode,
                   "output_tok_per_s": metrics.output_tok_per_s, "elapsed_s": metrics.elapsed_s,
                   "ttft_ms_median": metrics.ttft_ms_median, "tpot_ms_median": metrics.tpot_ms_median,
                   "preemptions": engine.preemptions, "unadmissions": engine.unadmissions,
                   "swapped_blocks": engine.swapper.stats.swapped_out_blocks,
                   "swap_gb_per_s": engine.swapper.stats.gb_per_s}
            runs.append(row)
            print(f"[preempt] {budget_name:8s} {mode:9s}: {row['output_tok_per_s']:8.1f} tok/s, "
                  f"{row['preemptions']} preemptions, swap {row['swap_gb_per_s']:.1f} GB/s", flush=True)
            del engine
    engine = PreemptionEngine(loaded, PreemptionEngineConfig(model=args.model, device=args.device,
                                                             block_size=args.block_size, num_blocks=4 * args.swap_blocks))
    swap = {"blocks": args.swap_blocks,
            "batched_gb_per_s": swap_bandwidth(engine, args.swap_blocks, per_block=False),
            "per_block_gb_per_s": swap_bandwidth(engine, args.swap_blocks, per_block=True)}
    print(f"[swap] {args.swap_blocks} blocks of every layer: batched {swap['batched_gb_per_s']:.2f} GB/s, "
          f"per block {swap['per_block_gb_per_s']:.2f} GB/s")
    device = loaded.model.device
    output = args.output or default_output("step07_preemption", "preempt", device.type, args.model)
    write_json(output, header | {"runs": runs, "swap_bandwidth": swap})
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
