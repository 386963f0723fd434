"""The tutorial tour: every step's engine runs on the embedded model, is checked against HF generate(),
and its throughput is printed; then step 08 serves a tiny model and is called through the openai SDK.
Run it with `make tour` (or `.venv/bin/python tour.py`)."""

from __future__ import annotations

import sys
import time

from common.checks import check_against_reference
from common.engine import Engine
from common.prompts import DEMO_PROMPTS
from common.sampling import SamplingParams
from common.steps import STEPS
from step08_serve.run import parse_args as server_args
from step08_serve.run import dry_run as server_dry_run

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
    print(f"The tour runs {len(STEPS)} engines on the embedded SmolLM2-135M-Instruct, on the CPU, "
          f"{len(DEMO_PROMPTS)} prompts x {MAX_TOKENS} tokens each, then step 08's server.")
    results = [(step.name, *tour_step(step.name, step.idea, step.engine_class())) for step in STEPS]
    print("\n=== step08_serve: an OpenAI-compatible server over one step loop (tiny model, the openai SDK)")
    served_ok = server_dry_run(server_args([])) == 0
    print("\nstep                     tok/s   parity")
    for name, tok_s, ok in results:
        print(f"{name:<24}{tok_s:>6.1f}   {'OK' if ok else 'FAILED'}")
    print(f"{'step08_serve':<24}{'-':>6}   {'OK' if served_ok else 'FAILED'} (streamed text equals the non-streamed)")
    return 0 if served_ok and all(ok for _, _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
