"""Exercise 09-token-budget: split a step's token budget between the decoders and the prefill chunks.

Write the body of `fill_budget`; `python -m exercises run 09-token-budget` plugs it into step 09's engine in
place of `ChunkedPrefillEngine.fill_budget` and runs step 09's tests and dry run on it.
"""

from __future__ import annotations

from step09_chunked_prefill.engine import Chunk, ChunkedPrefillEngine, ChunkedRequest


def fill_budget(self: ChunkedPrefillEngine, decoders: list[ChunkedRequest]) -> list[Chunk]:
    """This step's prefill chunks: one token of the budget for each decoder, what is left to prompts, in order.

    Inputs: `decoders`, this step's decoding requests (each computes one token; its blocks are already reserved:
    schedule nothing for them). `self.token_budget` is the most tokens a step computes. The candidates for
    chunks are the running requests that are not decoding (`self.is_decoding(r)` False: mid-prefill) and the
    waiting ones (`self.waiting`), together. `self.next_chunk(request, n)` reserves a request's next chunk of at
    most n tokens with its blocks (admitting it if it waits) and returns a `Chunk` (`.num_tokens` of its tokens
    from `.start` on), which may be shorter than n (the prompt ends, or the pool is short), or None: the request
    sits out this step.
    Returns: the chunks, in the order they were made.
    Rule: the decoders take their tokens off the budget first; the rest goes to the candidates in ONE list, most
    important first (`self.importance` sorts by priority, then arrival: smaller first), so a waiting request more
    important than one mid-prefill goes before it. Each chunk is at most what is left, and its tokens come off
    what is left; a candidate that sits out is skipped; no tokens left (or more decoders than the budget): no
    more chunks. Make the list once, before asking for chunks: a chunk can admit a waiting request or preempt a
    running one, which moves requests between `self.running` and `self.waiting`.

    Example: budget 8, decoder A, and B mid-prefill (a 40-token prompt, 14 computed): 7 tokens are left, and B's
    next chunk is Chunk(B, start=14, num_tokens=7): [that chunk]. Budget 16, no decoder, H running (priority 0,
    32 of 40 computed) and L waiting (priority 5, 40 tokens): H's last 8 tokens, then L's first 8:
    [Chunk(H, 32, 8), Chunk(L, 0, 8)].

    Hints (step09_chunked_prefill/README.md, "The idea: a budget, decoders first" and, in "Pitfalls", "More
    decoders than the budget").
    """
    raise NotImplementedError("write ChunkedPrefillEngine.fill_budget: see the hints in its docstring")
