"""Step 06's two changes measured apart, on one loaded model in one run: step 03, then step 06 with paged
attention only (`--no-batched-prefill`: one prefill forward per prompt, as step 03), then step 06 whole
(paged attention and all admitted prompts prefilled in one forward).

    .venv/bin/python step06_paged_attention/bench/bench_prefill.py --device cuda --model random:qwen2.5-7b --attn triton
    .venv/bin/python step06_paged_attention/bench/bench_prefill.py --model tiny-llama --batch-sizes 1,4 --max-tokens 8
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from common.bench import (
    Workload,
    default_output,
    evidence_header,
    fixed_workload,
    format_table,
    median_of,
    run_engine,
    write_evidence,
)
from common.cli import Parser, at_least, check_args, fail, parse_sizes
from common.engine import Engine
from common.loading import EMBEDDED_MODEL, ModelLoadError, load_model
from step03_vectorized_gather.engine import VectorizedGatherEngine
from step06_paged_attention.backends import ATTENTION_BACKENDS
from step06_paged_attention.engine import PagedAttentionEngine, PagedAttentionEngineConfig


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attn", choices=ATTENTION_BACKENDS, default="auto", help="step 06's attention backend")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--prompt-lens", default="32,1024", help="comma-separated prompt lengths, one workload each")
    p.add_argument("--max-tokens", type=at_least(1), default=128)
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--repeats", type=at_least(1), default=1)
    p.add_argument("--output", help="evidence file (default runs/step06_paged_attention/prefill-<device>-<model>.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        batches = parse_sizes("--batch-sizes", args.batch_sizes)
        prompt_lens = parse_sizes("--prompt-lens", args.prompt_lens)
        config = PagedAttentionEngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                            block_size=args.block_size, attn=args.attn)
        loaded = load_model(args.model, config.resolved_device(), config.resolved_dtype())
    except (ModelLoadError, ValueError) as err:
        return fail(err)
    workloads = [fixed_workload(b, n, args.max_tokens) for n in prompt_lens for b in batches]
    # One KV pool size for every engine: the largest workload's need.
    longest = max(prompt_lens) + args.max_tokens
    config.num_blocks = max(batches) * -(-longest // args.block_size) + 8
    engines: dict[str, Engine] = {
        "step03_vectorized_gather": VectorizedGatherEngine(loaded, config),
        "step06-no-batched-prefill": PagedAttentionEngine(loaded, replace(config, batched_prefill=False)),
        "step06_paged_attention": PagedAttentionEngine(loaded, config),
    }
    device = loaded.model.device
    header = evidence_header(device, args.model, loaded.model.dtype, systems=list(engines), attn=args.attn,
                             block_size=args.block_size, num_blocks=config.num_blocks, repeats=args.repeats,
                             torch_threads=torch.get_num_threads())
    output = args.output or default_output("step06_paged_attention", "prefill", device.type, args.model)
    runs = []
    for workload in workloads:
        warmup = Workload("warmup", workload.prompts, [min(n, 8) for n in workload.output_lens])
        for name, engine in engines.items():
            run_engine(engine, warmup, name)
            runs.append(median_of(lambda: run_engine(engine, workload, name), args.repeats))
            print(f"[prefill] {workload.name} {name}: {runs[-1].output_tok_per_s:.1f} tok/s", flush=True)
        write_evidence(output, header, runs, workloads)  # after each workload: a cut-short run keeps its figures
    print(format_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
