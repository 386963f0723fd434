"""A proposer that knows the answer: for benchmarks and tests, where real acceptance is not the question.

A random-weight model (the GPU benchmarks' `random:qwen2.5-7b`) says nothing a real text would: n-gram lookup
finds little, and what it finds means nothing. To measure what speculation gains at a given acceptance `a`,
`OracleProposer` replays each request's own greedy continuation, computed beforehand by plain decoding, and
replaces each proposed token by a wrong one with chance 1 - a. Each replacement is a pure function of the
prompt and the position, so a token proposed twice (after a rejection) is the same guess both times.
"""

from __future__ import annotations

import hashlib

from step11_speculative_decoding.proposers import NgramProposer, Proposal

from step11_speculative_decoding.request import SpeculativeRequest


class OracleProposer(NgramProposer):
    def __init__(self, k: int, continuations: dict[tuple[int, ...], list[int]], acceptance: float,
                 vocab_size: int, seed: int = 0) -> None:
        super().__init__(k)
        if not 0 <= acceptance <= 1:
            raise ValueError(f"the oracle's acceptance must be in [0, 1], got {acceptance}")
        self.continuations, self.acceptance, self.vocab_size, self.seed = continuations, acceptance, vocab_size, seed

    def guesses(self, request: SpeculativeRequest) -> list[int]:
        prompt = tuple(request.prompt_token_ids)
        done = len(request.output_token_ids)
        truth = self.continuations[prompt][done : done + self.k]
        return [self.corrupted(prompt, done + i, token) for i, token in enumerate(truth)]

    def corrupted(self, prompt: tuple[int, ...], position: int, token: int) -> int:
        # A cryptographic digest, not a checksum: CRC-32 of keys that differ in their last digit is correlated,
        # and a guess right after a miss came out right 80% of the time at a = 0.7.
        digest = hashlib.blake2b(f"{self.seed}:{hash(prompt)}:{position}".encode(), digest_size=8).digest()
        chance = int.from_bytes(digest, "little") / 2**64  # uniform in [0, 1), independent across positions
        return token if chance < self.acceptance else (token + 1) % self.vocab_size

    def most(self, request: SpeculativeRequest, limit: int) -> int:
        done = len(request.output_token_ids)  # asked every step for every decoder: no digests here
        return min(limit, self.k, len(self.continuations[tuple(request.prompt_token_ids)]) - done)

    def propose(self, requests: list[SpeculativeRequest], counts: list[int]) -> list[Proposal]:
        return [Proposal(self.guesses(r)[:count]) for r, count in zip(requests, counts, strict=True)]
