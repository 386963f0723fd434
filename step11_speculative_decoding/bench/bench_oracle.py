"""What speculation gains at a known acceptance, on a model whose real acceptance means nothing (random
weights: the GPU benchmarks' random:qwen2.5-7b). Each request is first decoded without speculation, which is
the baseline and gives its greedy continuation; then `OracleProposer` proposes that continuation with each
token wrong with chance 1 - a, for every acceptance a, proposal count k and batch size, in the same engine
(speculation off is `engine.proposer = None`). Reports, over the decode phase (once every request has its first
token), the time per output token as a ratio of speculation off, the ms per step, the proposals checked and kept,
tokens per verification row, and whether the tokens equal the baseline's (they must, where near-ties do not
decide: float32).

In bf16 with random weights, a verification row breaks a near-tie of the top two logits differently from a
decode step, and after that the oracle's continuation is another text: every later guess is wrong, whatever a.
So a run is repeated with the oracle replaying the tokens the last run produced (`--rounds`), until the run
produces exactly what the oracle replayed: then every guess was right with chance a, and the measured time is
the time at acceptance a. Speed does not depend on which tokens come out, only on how many each row keeps.

It runs step 11's engine unless `--step` names a later one: scripts/gpu_suite.sh's H200 sweep names the last step,
whose graphs verify the proposals.

    .venv/bin/python step11_speculative_decoding/bench/bench_oracle.py --model tiny-llama --batch-sizes 1,4 --max-tokens 16
    python step11_speculative_decoding/bench/bench_oracle.py --device cuda --model random:qwen2.5-7b \\
        --step step15_batch_invariant    # the H200 sweep, through the final engine's graphs
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from common.bench import default_output, evidence_header, fixed_workload, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_sizes
from common.loading import ModelLoadError, load_model
from common.sampling import SamplingParams
from common.steps import STEP_NAMES, engine_class
from step11_speculative_decoding.engine import SpeculativeEngine
from step11_speculative_decoding.bench.oracle import OracleProposer

THIS_STEP = "step11_speculative_decoding"
SPECULATIVE_STEPS = STEP_NAMES[STEP_NAMES.index(THIS_STEP):]  # the steps whose engines speculate: 11 and after
CPU_WARNING = ("[bench] on a CPU these times swing with whatever else the host is doing: read them for the shape of "
               "the curves (how the time per token moves with a, k and the batch), not for speedups to quote")


def decode_batch(engine: SpeculativeEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    """All prompts added at once, stepped to the end: their tokens, and the seconds and steps it took once every
    request had its first token (the decode phase: the prefill is the same with speculation or without)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.requests[engine.add_request(p, params)] for p in prompts]
    while not all(r.output_token_ids for r in requests):
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return [r.output_token_ids for r in requests], time.perf_counter() - start, steps


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bf16 on a GPU, fp32 on a CPU. Random weights give many near-ties, which bf16's rounding "
                        "breaks differently in a verification row than in a decode step: with float32 the oracle's "
                        "continuation stays the engine's own")
    p.add_argument("--step", default=THIS_STEP, choices=SPECULATIVE_STEPS,
                   help="the engine that speculates (default: this step's; later steps add graphs and kernels)")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--ks", default="2,4,8", help="proposals per decoder (--speculative-tokens values)")
    p.add_argument("--acceptances", default="0,0.5,0.7,0.9", help="the oracle's chance of a right token")
    p.add_argument("--prompt-len", type=at_least(1), default=32)
    p.add_argument("--max-tokens", type=at_least(1), default=128)
    p.add_argument("--token-cost", type=float, default=None, help="--speculative-token-cost (default: the engine's)")
    p.add_argument("--step-cost", type=float, default=None,
                   help="--speculative-step-cost (default: the engine's); both costs 0: every step verifies, "
                        "which measures what a verification step costs")
    p.add_argument("--rounds", type=int, default=8,
                   help="runs per point at most, each replaying the tokens of the one before, until the run's tokens "
                        "are the ones the oracle replayed (one run where they already are the baseline's)")
    p.add_argument("--output", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        batches, ks = parse_sizes("--batch-sizes", args.batch_sizes), parse_sizes("--ks", args.ks)
        acceptances = [float(a) for a in args.acceptances.split(",")]
        if any(not 0 <= a <= 1 for a in acceptances):
            raise CommandLineError("--acceptances: each must be in [0, 1]")
        device = torch.device(args.device)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
        loaded = load_model(args.model, device, dtype)
    except (CommandLineError, ModelLoadError, ValueError) as err:
        return fail(err)
    if device.type == "cpu":
        print(CPU_WARNING, flush=True)
    cls = engine_class(args.step)
    engine = cls(loaded, cls.config_class(device=args.device, speculative_tokens=max(ks),
                                          speculative_token_cost=args.token_cost,
                                          speculative_step_cost=args.step_cost))
    vocab = loaded.model.config.vocab_size
    decode_batch(engine, fixed_workload(2, args.prompt_len, 8).prompts, 8)  # warm-up
    rows: list[dict[str, Any]] = []
    for batch in batches:
        prompts = fixed_workload(batch, args.prompt_len, args.max_tokens, seed=batch).prompts
        engine.proposer = None
        truth, base_s, base_steps = decode_batch(engine, prompts, args.max_tokens)
        continuations = {tuple(p): t for p, t in zip(prompts, truth, strict=True)}
        rows.append({"batch": batch, "k": 0, "acceptance": None, "elapsed_s": base_s, "steps": base_steps,
                     "ms_per_step": base_s * 1e3 / base_steps,
                     "output_tokens": sum(map(len, truth)), "time_per_token_vs_off": 1.0})
        print(f"batch {batch}: speculation off {base_s * 1e3 / base_steps:.2f} ms per step", flush=True)
        for k in ks:
            for acceptance in acceptances:
                replayed = continuations
                for rounds in range(1, args.rounds + 1):
                    engine.proposer = OracleProposer(k, replayed, acceptance, vocab)
                    engine.proposed_tokens = engine.accepted_tokens = engine.verify_rows = 0
                    tokens, elapsed, steps = decode_batch(engine, prompts, args.max_tokens)
                    exact = tokens == [replayed[tuple(p)] for p in prompts]
                    if exact:
                        break
                    replayed = {tuple(p): t for p, t in zip(prompts, tokens, strict=True)}
                row = {"batch": batch, "k": k, "acceptance": acceptance, "elapsed_s": elapsed, "steps": steps,
                       "ms_per_step": elapsed * 1e3 / steps,
                       "output_tokens": sum(map(len, tokens)), "time_per_token_vs_off": elapsed / base_s,
                       "proposed": engine.proposed_tokens, "accepted": engine.accepted_tokens,
                       "verify_rows": engine.verify_rows,
                       "measured_acceptance": engine.accepted_tokens / max(1, engine.proposed_tokens),
                       "tokens_per_verify_row": (engine.verify_rows + engine.accepted_tokens) / max(1, engine.verify_rows),
                       "identical_to_off": tokens == truth, "rounds": rounds, "oracle_exact": exact}
                rows.append(row)
                print(f"batch {batch} k={k} a={acceptance}: {row['time_per_token_vs_off']:.2f}x the time per token, "
                      f"{row['ms_per_step']:.2f} ms per step, "
                      f"{row['tokens_per_verify_row']:.2f} tokens per verify row, {steps} steps, identical: "
                      f"{row['identical_to_off']}, oracle exact after {rounds} runs: {exact}", flush=True)
    header = evidence_header(loaded.model.device, args.model, loaded.model.dtype,
                             settings={"step": args.step, "batch_sizes": batches, "ks": ks, "acceptances": acceptances,
                                       "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
                                       "token_cost": engine.token_cost, "step_cost": engine.step_cost,
                                       "decode_token_cost": engine.decode_token_cost})
    write_json(args.output or default_output("step11_speculative_decoding", "oracle", args.device, args.model),
               header | {"runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
