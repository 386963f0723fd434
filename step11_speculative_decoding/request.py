"""Step 11's request record: step 10's, with the engine's acceptance estimate and each proposer's state."""

from __future__ import annotations

from dataclasses import dataclass, field

from step10_prefix_caching.engine import PrefixCachedRequest


@dataclass(eq=False)
class SpeculativeRequest(PrefixCachedRequest):
    acceptance: float = 0.5  # running estimate of the chance that its next proposal is kept
    steps_unchecked: int = 0  # steps it decoded without proposals since its last verification
    draft_table: list[int] = field(default_factory=list)  # the draft model's KV blocks (`DraftProposer`)
    draft_computed: int = 0  # its first tokens whose K/V the draft model holds
    # `NgramProposer`'s index of its token sequence: each n-gram with a token after it -> its latest start, kept
    # up to date one new token at a time (`ngram_indexed`: tokens indexed) so a lookup is not a scan of it all.
    ngram_index: dict[tuple[int, ...], int] = field(default_factory=dict)
    ngram_indexed: int = 0
