"""`python -m exercises engine`: the final engine with every exercise the learner has solved in place at once.

It runs the last step of common/steps.py (its dry run: tiny random models of each architecture against HF; then
a few of the demo prompts on the embedded model against HF; speculation on, and the demo prompts in a pool too
small for all of them, so that step 11's and step 07's functions run too) with each solved exercise's function
swapped in, as `python -m exercises run` swaps one. Each swapped function is wrapped to count its calls, so the report says
which of them the final engine ran, and which it did not reach on this device (a Triton kernel on a CPU, step
01's serial forward, step 05's trace reader, ...): those are swapped in but never claimed to have run.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from exercises.registry import EXERCISES, Exercise
from exercises.runner import DRY_RUN_SWITCHES, patched, status

SPECULATION = ["--speculative-tokens", "4"]  # n-gram guesses, up to 4 a step
# The demo prompts in a pool too small for all of them at once, so that step 07's preemption runs too.
TIGHT_POOL = {"block_size": 4, "num_blocks": 40}
DEMO_MAX_TOKENS = 16  # new tokens per demo prompt: enough to differ from HF where a function is wrong


def counted(function: Callable[..., Any], calls: Counter[str], key: str) -> Callable[..., Any]:
    """`function`, counting each call under `key`: how the report knows what ran."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        calls[key] += 1
        return function(*args, **kwargs)

    return call


def chosen(project: bool) -> tuple[list[Exercise], list[Exercise]]:
    """The exercises to swap in (all with `project`: their solutions; else the learner's solved ones), and the rest."""
    if project:
        return list(EXERCISES), []
    solved = [e for e in EXERCISES if status(e) == "solved"]
    return solved, [e for e in EXERCISES if e not in solved]


def demo_prompts_match_hf(step_name: str, switches: dict[str, Any], prompts: int, max_tokens: int) -> bool:
    """The first `prompts` demo prompts on the embedded model, greedy, compared token for token with HF."""
    from common.checks import check_against_reference
    from common.prompts import DEMO_PROMPTS
    from common.sampling import SamplingParams
    from common.steps import find_step

    engine_class = find_step(step_name).engine_class()
    engine = engine_class.from_config(engine_class.config_class(device="cpu", **switches))
    texts = DEMO_PROMPTS[:prompts]
    token_prompts = [engine.tokenizer.apply_chat_template(p) for p in texts]
    completions = engine.generate(token_prompts, SamplingParams(max_tokens=max_tokens))
    reports = check_against_reference(engine, token_prompts, completions, max_tokens)
    for text, completion, report in zip(texts, completions, reports, strict=True):
        verdict = "the same tokens as HF" if report.equal else f"DIFFERS from HF: {report.describe()}"
        print(f"  {text!r} -> {completion.text[:60]!r}: {verdict}")
    equal = sum(r.equal for r in reports)
    print(f"embedded model: {equal}/{len(reports)} prompts give HF's tokens exactly ({max_tokens} tokens each)")
    return equal == len(reports)


def run_engine(project: bool = False, prompts: int = 4, max_tokens: int = DEMO_MAX_TOKENS) -> bool:
    """Run the final engine with the exercises swapped in; print what ran and whether it matches HF."""
    from common.cli import main
    from common.steps import STEPS

    final = STEPS[-1]
    swapped, left_out = chosen(project)
    whose = "the project's solutions" if project else "your solved exercises"
    print(f"=== the final engine ({final.name}) with {whose} swapped in: {len(swapped)} of {len(EXERCISES)} ===")
    calls: Counter[str] = Counter()
    # With the step's switches on, as its exercises' dry run runs it (step 15's --batch-invariant: its two
    # exercises live behind it), and speculation on, so that step 11's run too (greedy: still HF's tokens).
    switches = [*DRY_RUN_SWITCHES.get(final.name, []), *SPECULATION]
    with ExitStack() as stack:
        for exercise in swapped:
            function = exercise.solution() if project else exercise.learner_function()
            stack.enter_context(patched(exercise, counted(function, calls, exercise.id)))
        print(f"\n--- {final.name}/run.py --dry-run {' '.join(switches)} ---")
        dry_run_ok = main(final.name, None, ["--dry-run", "--max-tokens", "6", *switches],
                          add_arguments=final.add_arguments) == 0
        print(f"\n--- the embedded model, {prompts} demo prompts ---")
        # The same switches as config fields: "--batch-invariant" is batch_invariant=True.
        fields = {flag.removeprefix("--").replace("-", "_"): True for flag in DRY_RUN_SWITCHES.get(final.name, [])}
        fields["speculative_tokens"] = int(SPECULATION[1])
        fields.update(TIGHT_POOL)
        tokens_ok = demo_prompts_match_hf(final.name, fields, prompts, max_tokens)
    print(f"\n=== which functions the final engine ran ({whose}) ===")
    width = max(len(e.target) for e in EXERCISES)
    for exercise in EXERCISES:
        if exercise in left_out:  # the project's code stays in place: whether it ran is not the learner's
            said = f"not solved ({status(exercise)}): the project's code in place"
        elif calls[exercise.id]:
            said = f"ran, {calls[exercise.id]} calls"
        else:
            said = "swapped in, not run by the final engine on this device"
        print(f"  {exercise.id:22s} {exercise.target:{width}s}  {said}")
    print(f"\ndry run: {'OK' if dry_run_ok else 'FAILED'}; embedded model: "
          f"{'the same tokens as HF' if tokens_ok else 'tokens DIFFER from HF'}")
    return dry_run_ok and tokens_ok
