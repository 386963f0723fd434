"""The tutorial tour: every finished step runs on the embedded model, is checked against HF generate(),
and its throughput is printed. Run it with `make tour` (or `python tour.py` inside the venv)."""

from __future__ import annotations

import sys
import time

from common.checks import check_against_reference
from common.engine import Engine
from common.prompts import DEMO_PROMPTS
from common.sampling import SamplingParams
from step01_serial.engine import SerialEngine
from step02_paged_kv.engine import PagedEngine
from step03_vectorized_gather.engine import VectorizedGatherEngine
from step06_paged_attention.engine import PagedAttentionEngine
from step07_preemption.engine import PreemptionEngine

# (step folder, what it teaches, its engine): one line per finished step.
STEPS: list[tuple[str, str, type[Engine]]] = [
    ("step01_serial", "serial decode, one forward per request, contiguous KV", SerialEngine),
    ("step02_paged_kv", "paged KV blocks, one batched decode forward, continuous batching", PagedEngine),
    ("step03_vectorized_gather", "step02 with one vectorized gather instead of loops", VectorizedGatherEngine),
    ("step06_paged_attention", "attention backends over the block table, one batched prefill (torch backend on CPU)",
     PagedAttentionEngine),
    ("step07_preemption", "optimistic admission, preemption by recompute or swap, priorities", PreemptionEngine),
]
MAX_TOKENS = 32


def tour_step(name: str, idea: str, engine_class: type[Engine]) -> tuple[float, bool]:
    print(f"\n=== {name}: {idea}")
    engine = engine_class.from_config(engine_class.config_class(device="cpu"))
    prompts = [engine.tokenizer.apply_chat_template(p) for p in DEMO_PROMPTS]
    start = time.perf_counter()
    completions = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    elapsed = time.perf_counter() - start
    for prompt, completion in zip(DEMO_PROMPTS, completions):
        print(f"  {prompt!r} -> {completion.text[:70]!r}")
    tokens = sum(len(c.token_ids) for c in completions)
    reports = check_against_reference(engine, prompts, completions, MAX_TOKENS)
    ok = all(r.ok for r in reports)
    print(f"  {tokens} tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} tok/s; "
          f"parity with HF generate(): {'OK' if ok else 'FAILED'} "
          f"({sum(r.equal for r in reports)}/{len(reports)} identical)")
    return tokens / elapsed, ok


def main() -> int:
    print(f"The tour runs {len(STEPS)} step(s) on the embedded SmolLM2-135M-Instruct, on the CPU, "
          f"{len(DEMO_PROMPTS)} prompts x {MAX_TOKENS} tokens each.")
    results = [(name, *tour_step(name, idea, cls)) for name, idea, cls in STEPS]
    print("\nstep                     tok/s   parity")
    for name, tok_s, ok in results:
        print(f"{name:<24}{tok_s:>6.1f}   {'OK' if ok else 'FAILED'}")
    return 0 if all(ok for _, _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
