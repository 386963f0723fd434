"""Correctness checks shared by every step's dry run, default run and tests.

A step is checked by its outputs: greedy generations compared token for token with Hugging Face
`generate()` on the same weights, with requests that arrive while others are already decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.engine import Engine
from common.loading import LoadedModel
from common.reference import ParityReport, compare_greedy, hf_model_for, reference_greedy
from common.request import Completion
from common.sampling import SamplingParams


def staggered_generate(
    engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
    arrive_every: int = 2,
) -> list[Completion]:
    """Like `generate`, but request i is added only after `i * arrive_every` steps have run,
    so later requests join while earlier ones are mid-decode (continuous batching's hard case)."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    requests = []
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] * arrive_every <= steps:
            index, prompt = pending.pop(0)
            request_id = engine.add_request(prompt, per_prompt[index])
            requests.append(engine.requests[request_id])
        engine.step()
        steps += 1
    return [r.to_completion() for r in requests]


def check_against_reference(
    engine: Engine, prompts: Sequence[Sequence[int]], completions: Sequence[Completion], max_tokens: int
) -> list[ParityReport]:
    """Compare each greedy completion with HF generate() on the same weights, prompt by prompt."""
    return check_model_against_reference(engine.loaded, engine.eos_token_ids, prompts, completions, max_tokens)


def check_model_against_reference(
    loaded: LoadedModel, eos_token_ids: frozenset[int], prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion], max_tokens: int,
) -> list[ParityReport]:
    """The same, given the model's weights rather than an engine (one whose weights are split across ranks)."""
    hf = hf_model_for(loaded)
    reports = []
    for prompt, completion in zip(prompts, completions, strict=True):
        theirs = reference_greedy(hf, prompt, max_tokens, eos_token_ids)
        reports.append(compare_greedy(hf, prompt, completion.token_ids, theirs))
    return reports


def compare_engines(
    loaded: LoadedModel, prompts: Sequence[Sequence[int]], ours: Sequence[Completion], theirs: Sequence[Completion]
) -> list[ParityReport]:
    """Compare two engines' greedy completions; where they differ, measure the tie under HF (loaded lazily)."""
    hf = None
    reports = []
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        if a.token_ids == b.token_ids:
            reports.append(ParityReport(equal=True))
            continue
        hf = hf or hf_model_for(loaded)
        reports.append(compare_greedy(hf, prompt, a.token_ids, b.token_ids))
    return reports
