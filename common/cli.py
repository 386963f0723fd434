"""The command line every step's `run.py` shares, so any two steps can be compared on the same input.

    python stepNN_name/run.py                      # the embedded model on a few prompts, checked against HF
    python stepNN_name/run.py --dry-run            # tiny random models of each architecture, checked, seconds
    python stepNN_name/run.py --bench              # throughput against HF generate(), JSON evidence
    python stepNN_name/run.py --prompts-file p.txt --output-json out.json --max-tokens 64

A step with its own switches passes `add_arguments` and an engine whose `config_class` has matching fields.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from common.bench import (
    Workload,
    evidence_header,
    fixed_workload,
    format_table,
    median_of,
    nanovllm_workload,
    run_engine,
    run_hf_generate,
    write_evidence,
    write_json,
)
from common.checks import check_against_reference, staggered_generate
from common.config import TINY_ARCHES
from common.engine import Engine
from common.loading import EMBEDDED_MODEL, ModelLoadError, model_names_help
from common.prompts import DEMO_PROMPTS
from common.reference import hf_model_for
from common.request import Completion
from common.sampling import SamplingParams


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL, help=f"one of: {model_names_help()}")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, or auto (default)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16, or auto (fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (run: 48, bench: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy, and is checked against HF")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and for sampling")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--prompts-file", type=Path, help="one prompt per line (write \\n for a newline), chat-templated")
    p.add_argument("--output-json", type=Path, help="write [{prompt, token_ids, text, finish_reason}] here")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with HF generate()")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="tiny random models of each architecture, checked")
    mode.add_argument("--bench", action="store_true", help="throughput against HF generate(); writes JSON evidence")
    bench = p.add_argument_group("benchmark")
    bench.add_argument("--batch-sizes", default="1,4,8", help="comma-separated batch sizes (default 1,4,8)")
    bench.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    bench.add_argument("--workload", choices=["fixed", "nanovllm"], default="fixed",
                       help="fixed: batch x prompt-len x max-tokens; nanovllm: 256 seqs, lengths in [100, 1024]")
    bench.add_argument("--repeats", type=int, default=1, help="runs per point; the median is kept")
    bench.add_argument("--no-hf", action="store_true", help="skip the HF generate() baseline")
    bench.add_argument("--bench-output", type=Path, help="evidence file (default results/<step>/...json)")
    return p


def main(
    engine_class: type[Engine],
    step_name: str,
    description: str | None,
    argv: Sequence[str] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    parser = build_parser(description or step_name)
    if add_arguments:
        add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        if args.dry_run:
            return dry_run(engine_class, args)
        if args.bench:
            return bench(engine_class, step_name, args)
        return run_prompts(engine_class, args)
    except (ModelLoadError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def read_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(DEMO_PROMPTS)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist: give a text file with one prompt per line")
    prompts = [line.replace("\\n", "\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} has no prompts: write one prompt per line")
    return prompts


def report_parity(engine: Engine, prompt_ids: list[list[int]], completions: list[Completion], max_tokens: int) -> bool:
    reports = check_against_reference(engine, prompt_ids, completions, max_tokens)
    for i, report in enumerate(reports):
        print(f"  prompt {i:2d}: {len(completions[i].token_ids):3d} tokens, {report.describe()}")
    ok = all(r.ok for r in reports)
    same = sum(r.equal for r in reports)
    print(f"parity with HF generate(): {same}/{len(reports)} identical, "
          f"{sum(r.ok and not r.equal for r in reports)} near-ties, {'OK' if ok else 'FAILED'}")
    return ok


def run_prompts(engine_class: type[Engine], args: argparse.Namespace) -> int:
    """The default run: generate for each prompt, print it, and check it against HF generate()."""
    prompts = read_prompts(args.prompts_file)
    max_tokens = args.max_tokens or 48
    engine = engine_class.from_args(args)
    print(f"[{engine_class.__name__}] model {args.model} on {engine.device} ({engine.model.dtype})")
    prompt_ids = [engine.tokenizer.apply_chat_template(p) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    completions = engine.generate(prompt_ids, params)
    elapsed = time.perf_counter() - start
    for prompt, c in zip(prompts, completions):
        print(f"\n>>> {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason.value}]")
    total = sum(len(c.token_ids) for c in completions)
    print(f"\n{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tok/s ({len(prompts)} prompts together)")
    if engine.memory_report():
        print(engine.memory_report())
    if args.output_json:
        rows = [
            {"prompt": p, "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason.value}
            for p, c in zip(prompts, completions)
        ]
        write_json(args.output_json, rows)
    if args.temperature > 0 or args.no_check:
        print("parity check not run (sampling, or --no-check)")
        return 0
    return 0 if report_parity(engine, prompt_ids, completions, max_tokens) else 1


def dry_run(engine_class: type[Engine], args: argparse.Namespace) -> int:
    """Tiny random models of every architecture, requests arriving while others decode, checked against HF."""
    config_class = engine_class.config_class
    ok = True
    for arch in TINY_ARCHES:
        # float32 for exact comparisons; the CPU unless a device was asked for (`--device cuda` checks a GPU).
        device = "cpu" if args.device == "auto" else args.device
        config = replace(config_class.from_args(args), model=f"tiny-{arch}", device=device, dtype="float32")
        engine = engine_class.from_config(config)
        prompt_ids = [engine.tokenizer.apply_chat_template(p) for p in DEMO_PROMPTS]
        max_tokens = args.max_tokens or 12
        completions = staggered_generate(engine, prompt_ids, SamplingParams(max_tokens=max_tokens), arrive_every=2)
        print(f"[dry run] tiny-{arch}: {len(prompt_ids)} requests arriving every 2 steps")
        ok &= report_parity(engine, prompt_ids, completions, max_tokens)
    print(f"dry run {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def bench(engine_class: type[Engine], step_name: str, args: argparse.Namespace) -> int:
    """This step against HF generate() on the same weights and workload; writes JSON evidence."""
    engine = engine_class.from_args(args)
    max_tokens = args.max_tokens or 128
    if args.workload == "nanovllm":
        workloads = [nanovllm_workload(seed=args.seed)]
    else:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        workloads = [fixed_workload(b, args.prompt_len, max_tokens, seed=args.seed) for b in sizes]
    hf = None if args.no_hf else hf_model_for(engine.loaded)
    pad = min(engine.eos_token_ids) if engine.eos_token_ids else 0
    # Taken before the runs: the commit and dirty flag describe the code that is about to run.
    header = evidence_header(
        engine.device, args.model, engine.model.dtype, step=step_name, engine=engine_class.__name__,
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        torch_threads=torch.get_num_threads(),
    )
    runs = []
    for workload in workloads:
        print(f"[bench] {workload.name} ...", flush=True)
        # Warm up on the same batch and prompt shapes (kernel selection, allocator), with few new tokens.
        warmup = Workload("warmup", workload.prompts, [min(n, 8) for n in workload.output_lens])
        run_engine(engine, warmup, step_name)
        runs.append(median_of(lambda: run_engine(engine, workload, step_name), args.repeats))
        if hf is not None and len(set(workload.output_lens)) == 1:
            run_hf_generate(hf, warmup, pad)
            runs.append(median_of(lambda: run_hf_generate(hf, workload, pad), args.repeats))
    print(format_table(runs))
    output = args.bench_output or Path("results") / step_name / (
        f"bench-{engine.device.type}-{args.model.replace(':', '-').replace('/', '-')}.json"
    )
    write_evidence(output, header, runs, workloads)
    return 0
