"""Exercise 11-proposal-counts: how many proposals a step checks, so that speculation pays for itself.

Write the body of `proposal_counts`; `python -m exercises run 11-proposal-counts` plugs it into step 11's engine
in place of `SpeculativeEngine.proposal_counts` and runs step 11's tests and dry run on it.
"""

from __future__ import annotations

from step11_speculative_decoding.engine import SpeculativeEngine, SpeculativeRequest


def proposal_counts(self: SpeculativeEngine, decoders: list[SpeculativeRequest], limits: list[int],
                    step_tokens: int) -> list[int]:
    """How many proposals to check for each decoder this step, `counts[i]` at most `limits[i]`.

    Inputs: `decoders` (each with `.acceptance`, a_i, the estimated chance that its next proposal is kept, and
    `.steps_unchecked`); `limits`, the most proposals each may check; `step_tokens`, the tokens the step computes
    anyway (one per decoder, and any prefill chunks). Costs, in decode steps: the plain step costs
    1 + d * step_tokens, a step that verifies n proposals 1 + s + c * (step_tokens + n) (d:
    `self.decode_token_cost`, s: `self.step_cost`, c: `self.token_cost`).
    Returns: `counts`, one int per decoder.
    Rule: decoder i's j-th proposal is kept with chance a_i ** j (kept one after another until the first miss),
    so with n proposals checked the step expects E = len(decoders) + (the sum of their chances) tokens. Rank every
    candidate proposal (i, j), j = 1 .. limits[i], most likely first, keep at most
    `self.speculation_token_limit() - step_tokens` of them, and check the n most likely for the n that gives the
    most tokens per cost, E / (1 + s + c * (step_tokens + n)); n = 0 (the plain step, len(decoders) /
    (1 + d * step_tokens)) wins ties. Then a decoder still at 0, with limits[i] > 0, whose `steps_unchecked`
    reached `self.probe_interval(len(decoders), step_tokens)` gets 1 anyway (so that its estimate can recover),
    while the token limit allows.

    Example (c = d = 0.1, s = 0, one decoder, a = 0.5, limit 8, step_tokens 1): the plain step gives
    1 / 1.1 = 0.91 tokens per cost; one proposal 1.5 / 1.2 = 1.25; two 1.75 / 1.3 = 1.35; three 1.875 / 1.4 =
    1.34: two it is, [2].

    Hints (step11_speculative_decoding/README.md, "When speculation pays"): E for every n comes out of one pass
    over the ranked chances.
    """
    raise NotImplementedError("write SpeculativeEngine.proposal_counts: see the hints in its docstring")
