"""Step 11's cheap guesses: the tokens a request is likely to produce next, checked later by the target model.

A proposer answers two questions for the engine, which decides in between how many guesses are worth checking:
`most(request, limit)`, how many tokens it could propose now, and `propose(requests, counts)`, the guesses.
Two kinds:

- `NgramProposer`, prompt lookup, here: no second model. Text that summarizes, rewrites, extracts from or
  edits a given text repeats runs of it, so the last few tokens of a request, found earlier in its prompt or
  output, are often followed by what comes next here too.
- `DraftProposer` (`draft.py`): a smaller model with the same tokenizer, run for a few tokens ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from step11_speculative_decoding.request import SpeculativeRequest


@dataclass
class Proposal:
    """A request's proposed tokens, and the distribution each was drawn from ([tokens, vocab]) where the
    proposer has one: None means each token was named outright (a one-hot distribution)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def most(self, request: SpeculativeRequest, limit: int) -> int:
        """How many tokens, at most `limit`, the proposer could propose for the request now."""

    def propose(self, requests: list[SpeculativeRequest], counts: list[int]) -> list[Proposal]:
        """Up to `counts[i]` tokens to follow each request's tokens (fewer where it has no more)."""

    def rollback(self, request: SpeculativeRequest) -> None:
        """The request's length changed (proposals were rejected, or it was preempted): forget what follows."""

    def release(self, request: SpeculativeRequest) -> None:
        """The request is finished or aborted: give back whatever is kept for it."""


class NgramProposer:
    """Proposes up to `k` tokens: the ones that followed the latest earlier occurrence of the request's last `n`
    tokens. The longest suffix is tried first (`max_n`, then shorter, down to `min_n`): a longer match is more
    specific, so what followed it is more likely to follow again; a single token (n = 1) matches often and
    guesses worst."""

    def __init__(self, k: int, max_n: int = 3, min_n: int = 1) -> None:
        if k < 1:
            raise ValueError(f"--speculative-tokens must be at least 1, got {k}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """At most `k` tokens to follow `token_ids` (the request's prompt and output so far); [] if no suffix of
        `min_n` to `max_n` tokens occurs earlier with anything after it."""
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = list(token_ids[length - n :])
            # The latest start j < length - n whose n tokens equal the suffix: its continuation begins at
            # j + n < length, so at least one token follows it (possibly part of the suffix itself).
            for j in range(length - n - 1, -1, -1):
                if token_ids[j] == suffix[0] and list(token_ids[j : j + n]) == suffix:
                    return list(token_ids[j + n : j + n + self.k])
        return []

    def indexed_lookup(self, request: SpeculativeRequest) -> list[int]:
        """`lookup` on the request's tokens, from its `ngram_index`: a scan of a long sequence every step would
        cost the host milliseconds per request. The index first takes in the n-grams that have gained a
        follower since the last call (the latest start of each wins), then answers for the suffix."""
        tokens, index = request.all_token_ids, request.ngram_index
        length = len(tokens)
        for n in range(self.min_n, self.max_n + 1):
            # Starts s whose n-gram is followed by a token (s + n < length), not indexed at the last call.
            for start in range(max(0, request.ngram_indexed - n), length - n):
                index[tuple(tokens[start : start + n])] = start
        request.ngram_indexed = length
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = index.get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start + n : start + n + self.k]
        return []

    def most(self, request: SpeculativeRequest, limit: int) -> int:
        return min(limit, len(self.indexed_lookup(request)))

    def propose(self, requests: list[SpeculativeRequest], counts: list[int]) -> list[Proposal]:
        return [Proposal(self.indexed_lookup(r)[:count]) for r, count in zip(requests, counts, strict=True)]

    def rollback(self, request: SpeculativeRequest) -> None:
        pass  # nothing is kept between steps: each lookup reads the request's tokens afresh

    def release(self, request: SpeculativeRequest) -> None:
        pass
