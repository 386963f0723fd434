"""The host's share of a decode step: what the CPU does per step besides running the model.

Once decode is a CUDA graph, the GPU's work per step is one replay; what remains on the host is Python:
scheduling (step 09's `schedule`), preparing the inputs (filling the static buffers), and turning sampled ids
into text (`process_tokens`: detokenizing, stop checks). The engine waits for each step's tokens before doing
any of it, so this time adds to every step. Measured here on the CPU with a tiny model, each of step 05's
phases timed by the host's clock (its seams, without the profiler), at several batch sizes with long prompts. Writes JSON evidence (by
default runs/step14_overlap_scheduling/host-per-step-cpu.json, ignored by git).

    .venv/bin/python step14_overlap_scheduling/bench/bench_host.py --batches 32,128,256
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_sizes
from common.loading import load_model
from common.profiling.phases import ATTENTION_RANGE, PHASES, STEP_RANGE, PhaseTimer, instrument
from common.sampling import SamplingParams
from step14_overlap_scheduling.engine import OverlapSchedulingEngine, OverlapSchedulingEngineConfig


def host_ms_per_step(batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    loaded = load_model("tiny-llama")
    engine = OverlapSchedulingEngine(loaded, OverlapSchedulingEngineConfig(
        device="cpu", block_size=16, attn="torch", num_blocks=batch * (-(-(prompt_len + steps + 8) // 16)),
        # A budget that prefills every prompt in one step: under a smaller one the first requests would reach
        # max_tokens while the last prompts wait, and the timed steps would hold fewer requests than `batch`.
        max_num_batched_tokens=batch * prompt_len, max_graph_batch=batch))
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    engine.step()  # the prefill, not measured
    engine.step()
    decoding = [r for r in engine.running if r.output_token_ids]
    assert len(decoding) == batch, f"{len(decoding)} of {batch} requests decode: the timed steps would not hold all"
    # Step 05's phases, timed by the host's clock: the profiler's own cost would swamp the smallest of them.
    timer = PhaseTimer()
    with instrument(engine, wrap=timer.wrap):
        for _ in range(steps):
            engine.step()
    own_ms = {name: 1e3 * seconds / steps for name, seconds in timer.own_seconds.items()}
    step_ms = sum(own_ms.values())  # the own times of the step and of everything inside it add up to the step
    own_ms["forward"] = own_ms.get("forward", 0.0) + own_ms.get(ATTENTION_RANGE, 0.0)
    per_step = {phase: own_ms.get(phase, 0.0) for phase in PHASES}
    per_step["not in a phase"] = own_ms[STEP_RANGE]
    per_step["host, all of it"] = step_ms - per_step["forward"]
    return per_step


def main() -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="32,128,256")
    p.add_argument("--prompt-len", type=at_least(1), default=512)
    p.add_argument("--steps", type=at_least(1), default=10)
    p.add_argument("--output", type=Path, help="evidence file (default runs/step14_overlap_scheduling/"
                                               "host-per-step-cpu.json, numbered if taken)")
    args = p.parse_args()
    try:  # before the model loads: a bad value is one line and exit code 2
        check_args(args)
        batches = parse_sizes("--batches", args.batches)
    except CommandLineError as err:
        return fail(err)
    torch.set_num_threads(1)  # the host's Python is single-threaded; keep the forward from borrowing cores
    header = evidence_header(torch.device("cpu"), "tiny-llama", torch.float32, prompt_len=args.prompt_len,
                             steps=args.steps)
    rows = []
    for batch in batches:
        per_step = host_ms_per_step(batch, args.prompt_len, args.steps)
        rows.append({"batch": batch, "ms_per_step": per_step})
        parts = ", ".join(f"{name} {ms:.2f}" for name, ms in per_step.items())
        print(f"batch {batch}: ms per step: {parts}", flush=True)
    output = args.output or default_output("step14_overlap_scheduling", "host-per-step", "cpu")
    write_json(output, header | {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
