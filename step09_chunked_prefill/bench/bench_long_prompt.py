"""Long prompts beside running decoders, and bursts of long prompts: what a token budget per step changes.

One model is loaded once; for each budget of `--budgets` the engine of `--step` is built anew on it. Two
scenarios (`--scenarios`):

- stall: `--decoders` requests (32-token prompts) decode steadily; then one prompt of `--long-prompt-len`
  tokens arrives. Recorded: the decoders' steady step (median gap between their tokens before it arrives),
  their gaps from its arrival until its first token (the longest, and the 99th percentile), its time to
  first token, and the tokens computed per second in that window (its prompt plus the decoders' tokens);
- burst: `--burst-requests` prompts of `--burst-prompt-len` tokens arrive at once and generate
  `--burst-max-tokens` each. Recorded: whether the engine survives (or runs out of memory), the time to
  finish, and the time to first token (median and longest).

`none` is no budget: every step takes all the work it has (the budget is set to the scenario's whole
prompt length), which is what step 07 does. A step before 09 has no budget: it runs once, as `none`.
Writes JSON evidence (by default runs/step09_chunked_prefill/long-prompt-<device>-<model>.json).

    .venv/bin/python step09_chunked_prefill/bench/bench_long_prompt.py                    # CPU, small scale
    .venv/bin/python step09_chunked_prefill/bench/bench_long_prompt.py --device cuda --model random:qwen2.5-7b \\
        --step step13_fused_decode --decoders 32 --long-prompt-len 16000 --budgets none,256,512,1024,2048,4096,8192 \\
        --burst-requests 64 --burst-prompt-len 2080
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common.bench import default_output, evidence_header, percentile, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_names, parse_sizes
from common.engine import Engine
from common.loading import EMBEDDED_MODEL, LoadedModel, ModelLoadError, load_model
from common.sampling import SamplingParams
from common.steps import STEP_NAMES, engine_class
from step09_chunked_prefill.engine import ChunkedPrefillEngineConfig

PROMPT_IDS = (1000, 40000)  # ordinary text pieces in every bundled tokenizer (as common/bench.py's workloads)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*PROMPT_IDS) for _ in range(length)]


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def build_engine(loaded: LoadedModel, step: str, budget: int | None, args: argparse.Namespace,
                 max_num_seqs: int) -> Engine:
    cls = engine_class(step)
    settings: dict[str, Any] = dict(model=args.model, device=str(loaded.model.device), dtype=args.dtype,
                                    max_num_seqs=max_num_seqs, attn=args.attn, block_size=args.block_size)
    if issubclass(cls.config_class, ChunkedPrefillEngineConfig):
        settings["max_num_batched_tokens"] = budget
    if args.mixed_graphs is not None:
        settings["mixed_graphs"] = args.mixed_graphs
    return cls(loaded, cls.config_class(**settings))


def warm_up(engine: Engine, rng: random.Random) -> None:
    """Compile the kernels a run will meet (prefill chunks, mixed steps, decode) before anything is timed."""
    for length in (600, 40):
        engine.add_request(random_prompt(rng, length), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sync(engine)


def run_stall(engine: Engine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Decoders decoding; one long prompt arrives. Returns the gaps it causes and its time to first token."""
    times: dict[str, list[float]] = {}
    decoders = [engine.add_request(random_prompt(rng, 32), SamplingParams(max_tokens=4096, ignore_eos=True))
                for _ in range(args.decoders)]

    def step() -> list[str]:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                times.setdefault(out.request_id, []).append(now)
        return [o.request_id for o in outputs if o.new_token_ids]

    while min(len(times.get(d, [])) for d in decoders) < 10:  # prefilled, and decoding for a while
        step()
    steady_from = {d: len(times[d]) for d in decoders}
    for _ in range(args.steady_steps):
        step()
    steady = statistics.median(b - a for d in decoders for a, b in zip(times[d][steady_from[d]:], times[d][steady_from[d] + 1:]))
    arrival = time.perf_counter()
    long_id = engine.add_request(random_prompt(rng, args.long_prompt_len), SamplingParams(max_tokens=8, ignore_eos=True))
    before = {d: len(times[d]) for d in decoders}
    step_ends = [arrival]
    while long_id not in times:
        step()
        step_ends.append(time.perf_counter())
    steps = len(step_ends) - 1
    first_token = times[long_id][0]
    step()  # one more: the decoders' gap that ends after the long prompt's first token counts too
    gaps = [b - a for d in decoders for a, b in zip(times[d][before[d] - 1:], times[d][before[d]:])]
    decoded = sum(len(times[d]) - before[d] for d in decoders)
    window = first_token - arrival
    for rid in list(engine.requests):
        engine.abort(rid)
    return {
        "decoders": args.decoders, "long_prompt_len": args.long_prompt_len, "steps_until_first_token": steps,
        "steady_step_ms": steady * 1e3, "longest_gap_ms": max(gaps) * 1e3, "p99_gap_ms": percentile(gaps, 0.99) * 1e3,
        "longest_gap_vs_steady": max(gaps) / steady, "p99_gap_vs_steady": percentile(gaps, 0.99) / steady,
        "long_prompt_ttft_ms": window * 1e3,
        "tokens_per_s_in_window": (args.long_prompt_len + decoded) / window,
        "decode_tokens_per_s_in_window": decoded / window,
        "step_ms": [round((b - a) * 1e3, 2) for a, b in zip(step_ends, step_ends[1:])],
    }


def run_burst(engine: Engine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Many long prompts at once, to the end. Returns whether the engine survived, and how fast it was."""
    params = SamplingParams(max_tokens=args.burst_max_tokens, ignore_eos=True)
    sync(engine)
    start = time.perf_counter()
    ids = [engine.add_request(random_prompt(rng, args.burst_prompt_len), params) for _ in range(args.burst_requests)]
    first: dict[str, float] = {}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                first.setdefault(out.request_id, time.perf_counter())
    except torch.OutOfMemoryError as err:
        return {"survived": False, "error": f"torch.OutOfMemoryError: {str(err).splitlines()[0]}",
                "requests_with_a_token": len(first)}
    elapsed = time.perf_counter() - start
    ttft = [first[i] - start for i in ids]
    return {"survived": True, "elapsed_s": elapsed, "ttft_ms_p50": statistics.median(ttft) * 1e3,
            "ttft_ms_max": max(ttft) * 1e3, "blocks_in_use_after": engine.stats().get("kv_blocks_used", 0),
            "output_tok_per_s": args.burst_requests * args.burst_max_tokens / elapsed}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--step", default="step09_chunked_prefill", help=f"one of {','.join(STEP_NAMES[4:])}")
    p.add_argument("--attn", default="auto")
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--mixed-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="step 12 and later: mixed steps on static buffers (default: the step's own default)")
    p.add_argument("--budgets", default="none,16,64,256",
                   help="tokens per step, comma-separated; none: no budget; default: the engine's default budget")
    p.add_argument("--scenarios", default="stall,burst")
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--long-prompt-len", type=int, default=1024)
    p.add_argument("--steady-steps", type=int, default=20)
    p.add_argument("--burst-requests", type=int, default=8)
    p.add_argument("--burst-prompt-len", type=int, default=256)
    p.add_argument("--burst-max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None)
    return p


def parse_budgets(text: str) -> list[str]:
    """Labels in order: "none", "default", then the numbers (checked)."""
    budgets = [part.strip() for part in text.split(",")]
    numbers = [b for b in budgets if b not in ("none", "default")]
    sizes = parse_sizes("--budgets", ",".join(numbers)) if numbers else []
    return [label for label in ("none", "default") if label in budgets] + [str(n) for n in sizes]


def budget_of(label: str, whole: int) -> int | None:
    """The engine's budget for a label: "none" is one as large as the scenario's whole prompt length (no chunk
    is ever cut), "default" is None (the engine picks its own), a number is itself."""
    if label == "none":
        return whole
    return None if label == "default" else int(label)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        budgets = parse_budgets(args.budgets)
        scenarios = parse_names("--scenarios", args.scenarios, ("stall", "burst"))
        if args.step not in STEP_NAMES[4:]:
            raise CommandLineError(f"--step must be step 07 or later: {','.join(STEP_NAMES[4:])} (got {args.step})")
        has_budget = issubclass(engine_class(args.step).config_class, ChunkedPrefillEngineConfig)
        if args.mixed_graphs is not None and not hasattr(engine_class(args.step).config_class, "mixed_graphs"):
            raise CommandLineError(f"--mixed-graphs is a switch of step 12 and later, not of {args.step}")
        loaded = load_model(args.model, torch.device(args.device if args.device != "auto" else "cpu"),
                            ChunkedPrefillEngineConfig(device=args.device, dtype=args.dtype).resolved_dtype(),
                            args.seed)
    except (CommandLineError, ModelLoadError, ValueError) as err:
        return fail(err)
    device = loaded.model.device
    header = evidence_header(device, args.model, loaded.model.dtype, step=args.step,
                             settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    rng = random.Random(args.seed)
    results: dict[str, list[dict[str, Any]]] = {"stall": [], "burst": []}
    output = args.output or default_output("step09_chunked_prefill", "long-prompt", device.type, args.model)
    for label in budgets if has_budget else ["none"]:
        for scenario in scenarios:
            whole = (args.long_prompt_len + args.decoders if scenario == "stall"
                     else args.burst_requests * args.burst_prompt_len)
            max_num_seqs = args.decoders + 1 if scenario == "stall" else args.burst_requests
            try:
                engine = build_engine(loaded, args.step, budget_of(label, whole) if has_budget else None, args,
                                      max_num_seqs)
            except torch.OutOfMemoryError as err:
                results[scenario].append({"budget": label, "survived": False,
                                          "error": f"at start-up: {str(err).splitlines()[0]}"})
                write_json(output, header | results)
                continue
            warm_up(engine, rng)
            row = run_stall(engine, args, rng) if scenario == "stall" else run_burst(engine, args, rng)
            row = {"budget": label, "budget_tokens": getattr(engine, "token_budget", None),
                   "kv_blocks": engine.stats().get("kv_blocks_total"),
                   "step_memory_mib": (getattr(engine, "step_memory_bytes", None) or 0) / 2**20} | row
            results[scenario].append(row)
            write_json(output, header | results)  # after every row: a run cut short keeps what it measured
            print(f"[{scenario}] budget {label}: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                if k not in ("budget", "step_ms")),
                flush=True)
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
