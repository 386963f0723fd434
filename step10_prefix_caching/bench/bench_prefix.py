"""Prefix caching on against off, on the two workloads it is for. One model is loaded; the engine of `--step`
is built anew for each setting.

- shared: `--requests` prompts arrive at once, sharing a `--prefix-len`-token prefix, each with its own
  `--suffix-len` tokens after it. Recorded: time to first token (median), the prompt tokens computed
  (sent minus found cached), the time to finish;
- chat: `--conversations` conversations of `--turns` turns; each turn sends the whole history again (every
  earlier user message and answer) plus `--user-len` new tokens, and the next turn is sent once every
  conversation has its answer. Recorded: prompt tokens sent and computed, the hit rate, output tokens per
  second.

Writes JSON evidence (by default runs/step10_prefix_caching/prefix-<device>-<model>.json).

    .venv/bin/python step10_prefix_caching/bench/bench_prefix.py                            # CPU, small scale
    .venv/bin/python step10_prefix_caching/bench/bench_prefix.py --device cuda --model random:qwen2.5-7b \\
        --step step13_fused_decode --requests 64 --prefix-len 2048 --suffix-len 32 --conversations 32 --turns 4 --user-len 256
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail
from common.engine import Engine
from common.loading import EMBEDDED_MODEL, LoadedModel, ModelLoadError, load_model
from common.sampling import SamplingParams
from common.steps import STEP_NAMES, engine_class
from step10_prefix_caching.engine import PrefixCachingEngine, PrefixCachingEngineConfig

CACHING_STEPS = STEP_NAMES[STEP_NAMES.index("step10_prefix_caching"):]
PROMPT_IDS = (1000, 40000)  # ordinary text pieces in every bundled tokenizer


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*PROMPT_IDS) for _ in range(n)]


def run_wave(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[float], float]:
    """Add every prompt at once and step to the end: each one's output, time to first token, and the time."""
    start = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    requests = [engine.requests[i] for i in ids]
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
    return [r.output_token_ids for r in requests], [first[i] for i in ids], time.perf_counter() - start


def counters(engine: PrefixCachingEngine) -> tuple[int, int]:
    return engine.queried_tokens, engine.hit_tokens


def shared_prefix(engine: PrefixCachingEngine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    prefix = tokens(rng, args.prefix_len)
    prompts = [prefix + tokens(rng, args.suffix_len) for _ in range(args.requests)]
    queried, hit = counters(engine)
    _, ttft, elapsed = run_wave(engine, prompts, args.max_tokens)
    sent = sum(len(p) for p in prompts)
    hits = engine.hit_tokens - hit
    return {"requests": args.requests, "prompt_tokens_sent": sent, "prompt_tokens_computed": sent - hits,
            "ttft_ms_p50": statistics.median(ttft) * 1e3, "ttft_ms_max": max(ttft) * 1e3, "elapsed_s": elapsed,
            "queried_tokens": engine.queried_tokens - queried}


def multi_turn(engine: PrefixCachingEngine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    histories = [tokens(rng, args.user_len) for _ in range(args.conversations)]
    sent = outputs = 0
    hit_before = engine.hit_tokens
    start = time.perf_counter()
    for turn in range(args.turns):
        answers, _, _ = run_wave(engine, histories, args.max_tokens)
        sent += sum(len(h) for h in histories)
        outputs += sum(len(a) for a in answers)
        histories = [h + a + tokens(rng, args.user_len) for h, a in zip(histories, answers)]
    elapsed = time.perf_counter() - start
    hits = engine.hit_tokens - hit_before
    return {"conversations": args.conversations, "turns": args.turns, "prompt_tokens_sent": sent,
            "prompt_tokens_computed": sent - hits, "hit_rate": hits / sent,
            "output_tok_per_s": outputs / elapsed, "elapsed_s": elapsed}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attn", default="auto")
    p.add_argument("--step", default="step10_prefix_caching", help=f"one of {','.join(CACHING_STEPS)}")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--max-tokens", type=at_least(1), default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None)
    return p


def build_engine(loaded: LoadedModel, args: argparse.Namespace, caching: bool) -> PrefixCachingEngine:
    cls = engine_class(args.step)
    config = cls.config_class(model=args.model, device=str(loaded.model.device), dtype=args.dtype, attn=args.attn,
                              enable_prefix_caching=caching)
    return cls(loaded, config)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        if args.step not in CACHING_STEPS:
            raise CommandLineError(f"--step must be step 10 or later: {','.join(CACHING_STEPS)} (got {args.step})")
        device = torch.device(args.device if args.device != "auto" else "cpu")
        loaded = load_model(args.model, device, PrefixCachingEngineConfig(device=args.device, dtype=args.dtype)
                            .resolved_dtype(), args.seed)
    except (CommandLineError, ModelLoadError, ValueError) as err:
        return fail(err)
    header = evidence_header(loaded.model.device, args.model, loaded.model.dtype, step=args.step,
                             settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    rows = []
    for caching in (True, False):
        engine = build_engine(loaded, args, caching)
        run_wave(engine, [tokens(random.Random(99), 64)], 4)  # warm-up, on tokens no workload shares
        for offset, (name, scenario) in enumerate((("shared", shared_prefix), ("chat", multi_turn))):
            # Each scenario's own tokens (another seed): the chat must not find the shared prefix's blocks.
            row = {"scenario": name, "prefix_caching": caching} | scenario(engine, args, random.Random(args.seed + offset))
            rows.append(row)
            print(f"[{name}] caching {'on ' if caching else 'off'}: " + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                if k not in ("scenario", "prefix_caching")), flush=True)
        del engine
    write_json(args.output or default_output("step10_prefix_caching", "prefix", loaded.model.device.type, args.model),
               header | {"runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
