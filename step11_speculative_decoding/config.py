"""Step 11's settings: how many tokens to propose, by which method, and what a proposal is taken to cost."""

from __future__ import annotations

from dataclasses import dataclass

from step10_prefix_caching.engine import PrefixCachingEngineConfig


@dataclass
class SpeculativeEngineConfig(PrefixCachingEngineConfig):
    speculative_tokens: int = 0  # k, the most tokens proposed for a decoder per step; 0: no speculation
    speculative_method: str = "ngram"  # ngram | draft
    draft_model: str | None = None  # --speculative-method draft: a model with the target's tokenizer
    speculative_token_cost: float | None = None  # see engine.DEFAULT_TOKEN_COST; with a step cost of 0, 0 checks all
    speculative_decode_token_cost: float | None = None  # see engine.DEFAULT_DECODE_TOKEN_COST
    speculative_step_cost: float | None = None  # see engine.DEFAULT_STEP_COST
