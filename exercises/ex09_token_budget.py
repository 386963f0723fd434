"""Exercise 09-token-budget: split a step's token budget between the decoders and the prefill chunks.

Write the body of `fill_budget`; `python -m exercises run 09-token-budget` plugs it into step 09's engine in
place of `ChunkedPrefillEngine.fill_budget` and runs step 09's tests and dry run on it.
"""

from __future__ import annotations

from step09_chunked_prefill.engine import Chunk, ChunkedPrefillEngine, ChunkedRequest


def fill_budget(self: ChunkedPrefillEngine, decoders: list[ChunkedRequest]) -> list[Chunk]:
    """This step's prefill chunks: one token of the budget for each decoder, what is left to prompts, in order.

    A step computes at most `self.token_budget` tokens. `decoders` are this step's decoding requests: each
    computes one token, and its blocks are already reserved; count them, schedule nothing for them. The tokens
    left go to the candidates, in ONE list: the running requests that are not decoding (`self.is_decoding(r)`
    is False: mid-prefill) and the waiting ones (`self.waiting`) together, sorted most important first
    (`sorted(..., key=self.importance)`: smaller sorts first), so a waiting request more important than one
    mid-prefill goes before it. Make that list once, before the loop: a chunk can admit a waiting request or
    preempt a running one, which moves requests between `self.running` and `self.waiting`.

    Then, for each candidate in that order, while tokens are left (none left: stop; more decoders than the
    budget: no chunk at all), `self.next_chunk(request, left)` reserves the request's next chunk of at most
    `left` tokens, with its blocks, admitting the request if it waits. It returns a `Chunk` (`.num_tokens` of
    the request's tokens from `.start` on), which may be shorter than `left` (the end of the prompt, or a
    pool too short), or None if the request sits out this step: skip it and go on. Each chunk's tokens come
    off what is left. Return the chunks in the order they were made.

    Example: budget 8, decoder A, and B mid-prefill (a 40-token prompt, 14 tokens computed): 7 tokens are
    left, and next_chunk(B, 7) gives Chunk(B, start=14, num_tokens=7): [that chunk]. Budget 16, no decoder, H
    running (priority 0, 32 of 40 computed) and L waiting (priority 5, 40 tokens): H's chunk of its last 8
    tokens, then L's first 8 (16 - 8 are left): [Chunk(H, 32, 8), Chunk(L, 0, 8)].

    Hints (step09_chunked_prefill/README.md, "The idea: a budget, decoders first" and, in "Pitfalls", "More
    decoders than the budget"): the decoders take `len(decoders)` tokens off the budget before any chunk;
    priority, then arrival, is already what `self.importance` sorts by.
    """
    raise NotImplementedError("write ChunkedPrefillEngine.fill_budget: see the hints in its docstring")
