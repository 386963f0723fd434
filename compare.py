"""Every step on the same model and workload, in one run: the tutorial's performance curve.

    .venv/bin/python compare.py                                   # CPU, embedded model, batch 1/4/8, 128 new tokens
    .venv/bin/python compare.py --device cuda --model random:qwen2.5-7b --batch-sizes 1,4,8,32 --repeats 3

One model is loaded once and shared by every step's engine and by the HF generate() baseline, so the
figures differ only by what the steps do. Writes one JSON evidence file with every run, by default
runs/compare/<device>-<model>.json (ignored by git; -2, -3, ... added to the name if an earlier run has it;
`--output results/gpu/...` replaces committed evidence), and its plot next to it (the same name with .png,
drawn by common/plots/throughput.py; skipped if matplotlib is not installed).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_names, parse_sizes
from common.config import EMBEDDED_MODEL
from common.steps import STEP_NAMES
from step06_paged_attention.run import ATTENTION_BACKENDS

if TYPE_CHECKING:  # for the annotations only: torch and the engines load once the command line is accepted
    from common.bench import RunMetrics, Workload
    from common.engine import Engine


def parse_max_batch(specs: list[str]) -> dict[str, int]:
    """`--max-batch step01_serial=8` -> {"step01_serial": 8}: a step is skipped at larger batches."""
    limits = {}
    for spec in specs:
        name, _, value = spec.partition("=")
        if name not in STEP_NAMES or not value.isdecimal() or int(value) < 1:
            raise CommandLineError(f"--max-batch takes STEP=N with N at least 1 and STEP one of "
                                   f"{','.join(STEP_NAMES)} (got {spec!r})")
        limits[name] = int(value)
    return limits


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--steps", default=",".join(STEP_NAMES), help="comma-separated step names")
    p.add_argument("--batch-sizes", default="1,4,8")
    p.add_argument("--prompt-len", type=at_least(1), default=32)
    p.add_argument("--max-tokens", type=at_least(1), default=128)
    p.add_argument("--repeats", type=at_least(1), default=1)
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--attn", choices=ATTENTION_BACKENDS, default="auto", help="step06's attention backend")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--hf-static-max-batch", type=at_least(0), default=0, metavar="N",
                   help="also run HF generate() with a static cache (torch.compile'd on CUDA) up to batch N; "
                        "each new batch size compiles again, for a minute or so")
    p.add_argument("--sampling", type=sampling_fields, default={}, metavar="JSON",
                   help='SamplingParams fields every request also sets, as a JSON object, e.g. '
                        '\'{"presence_penalty": 0.5, "logprobs": 5}\' (what clients send costs what it costs)')
    p.add_argument("--max-batch", action="append", default=[], metavar="STEP=N",
                   help="skip STEP above batch N (step01 is serial: its tok/s does not change with batch, "
                        "only its run time grows); repeatable")
    p.add_argument("--output", type=Path,
                   help="evidence file (default runs/compare/<device>-<model>.json, numbered if taken)")
    return p


WORKLOAD_FIELDS = {"max_tokens", "ignore_eos"}  # every request runs to the workload's length


def sampling_fields(text: str) -> dict[str, Any]:
    """--sampling: a JSON object of SamplingParams fields, each checked by SamplingParams itself."""
    from common.sampling import SamplingParams

    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("give a JSON object")
        fixed = sorted(set(fields) & WORKLOAD_FIELDS)
        if fixed:
            raise ValueError(f"{', '.join(fixed)} belong to the workload: use --max-tokens")
        SamplingParams(**fields)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return fields


def measure_step(name: str, engine: Engine, workloads: list[Workload], repeats: int,
                 sampling: dict[str, Any]) -> list[RunMetrics]:
    """One step's engine on each workload, after a short warm-up on the same shapes."""
    from common.bench import Workload, median_of, run_engine

    runs = []
    for workload in workloads:
        started = time.perf_counter()
        run_engine(engine, Workload("warmup", workload.prompts, [min(n, 8) for n in workload.output_lens]), name,
                   sampling)
        runs.append(median_of(lambda: run_engine(engine, workload, name, sampling), repeats))  # noqa: B023
        print(f"[compare] {workload.name} {name}: {runs[-1].output_tok_per_s:.1f} tok/s "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # every value checked before the model loads: a bad one is one line and exit code 2
        check_args(args)
        steps = parse_names("--steps", args.steps, STEP_NAMES)
        batch_sizes = parse_sizes("--batch-sizes", args.batch_sizes)
        max_batch = parse_max_batch(args.max_batch)
        if args.sampling and not args.no_hf:
            raise CommandLineError("--sampling sets the engines' requests only, not HF generate()'s: add --no-hf")
    except CommandLineError as err:
        return fail(err)
    # Only now, with the command line accepted, do torch, transformers and the engines load.
    import torch

    from common.bench import (
        Workload,
        default_output,
        evidence_header,
        fixed_workload,
        format_table,
        median_of,
        run_hf_generate,
        write_evidence,
    )
    from common.loading import ModelLoadError, load_model
    from common.reference import hf_model_for
    from common.shared_model import build_engine, release_memory
    from step02_paged_kv.engine import PagedEngineConfig

    base = PagedEngineConfig(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size)
    try:
        loaded = load_model(args.model, base.resolved_device(), base.resolved_dtype())
    except ModelLoadError as err:  # an unknown model, a missing folder: what to pass instead, in one line
        return fail(err)
    hf = None if args.no_hf else hf_model_for(loaded)
    pad = min(loaded.tokenizer.eos_token_ids)
    workloads = [fixed_workload(b, args.prompt_len, args.max_tokens) for b in batch_sizes]
    # Size the KV pool once for the largest workload, the same for every paged step.
    longest = max(len(p) + n for w in workloads for p, n in zip(w.prompts, w.output_lens))
    blocks = max(len(w.prompts) for w in workloads) * -(-longest // args.block_size) + 8
    device = loaded.model.device
    # Taken before the runs: the commit and dirty flag describe the code that is about to run.
    header = evidence_header(device, args.model, loaded.model.dtype, steps=steps, block_size=args.block_size,
                             num_blocks=blocks, attn=args.attn, repeats=args.repeats, max_batch=max_batch,
                             hf_static_max_batch=args.hf_static_max_batch, sampling=args.sampling,
                             torch_threads=torch.get_num_threads())
    output = args.output or default_output("compare", device.type, args.model)
    runs = []
    # One engine at a time, built just before its runs and dropped after them (common/shared_model.py says why).
    for name in steps:
        fits = [w for w in workloads if len(w.prompts) <= max_batch.get(name, len(w.prompts))]
        for workload in (w for w in workloads if w not in fits):
            print(f"[compare] {workload.name} {name}: skipped (--max-batch {name}={max_batch[name]})")
        engine = build_engine(name, loaded, base, blocks, args.attn, max(len(w.prompts) for w in workloads))
        runs += measure_step(name, engine, fits, args.repeats, args.sampling)
        del engine
        release_memory(device)
        write_evidence(output, header, runs, workloads)  # after every step: a cut-short run keeps its figures
    for workload in workloads:
        warmup = Workload("warmup", workload.prompts, [min(n, 8) for n in workload.output_lens])
        if hf is not None:
            run_hf_generate(hf, warmup, pad)
            runs.append(median_of(lambda: run_hf_generate(hf, workload, pad), args.repeats))
            print(f"[compare] {workload.name} hf-generate: {runs[-1].output_tok_per_s:.1f} tok/s", flush=True)
        if hf is not None and len(workload.prompts) <= args.hf_static_max_batch:
            started = time.perf_counter()
            # Warm up on the workload itself: the static cache's length is part of what gets compiled.
            run_hf_generate(hf, workload, pad, "static")
            runs.append(median_of(lambda: run_hf_generate(hf, workload, pad, "static"), args.repeats))
            print(f"[compare] {workload.name} hf-generate-static: {runs[-1].output_tok_per_s:.1f} tok/s "
                  f"({time.perf_counter() - started:.0f} s with compiling)", flush=True)
        write_evidence(output, header, runs, workloads)  # after every batch size: a cut-short run keeps its figures
    runs.sort(key=lambda run: run.batch)  # the table by batch size, each step's run and HF's side by side
    print(format_table(runs))
    evidence = write_evidence(output, header, runs, workloads)  # prints where
    try:
        from common.plots.throughput import write_plot

        print(f"wrote {write_plot([evidence], evidence.with_suffix('.png'))}")
    except ImportError as err:  # matplotlib is a test extra, not a dependency of the engine
        print(f"no plot written ({err}); pip install matplotlib, then python scripts/plot_compare.py {evidence}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
