"""Step 11's verification steps replayed as CUDA graphs, per small token bucket.

A speculative step (decoders, verification rows of k + 1 tokens, perhaps a prefill chunk) is step 09's mixed
step with an output at every token of a verification row rather than at each row's last. Padded to the smallest
mixed bucket, 256 tokens, a batch-1 verification of 5 tokens would compute 51 times the tokens it needs; so its
buckets are small (8, 16, 32, ... up to `VERIFY_MAX_TOKENS`), and the proposals of a step stop there
(`CudaGraphEngine.speculation_token_limit`). The graph writes every token's output to a static buffer; the
engine takes the rows it needs and verifies them as step 11 does, on the host's side of the replay. A step whose
rows are all greedy needs no logits, only each token's greedy token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.model import CausalLM
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import AttentionBackend
from step12_cuda_graph.decode_graphs import GREEDY, LOGITS
from step12_cuda_graph.mixed_graphs import MixedChunk, MixedStepGraphs, doubling_buckets

SMALLEST_VERIFY_BUCKET = 8
VERIFY_MAX_TOKENS = 512  # the largest verification step replayed; 512 float32 rows of Qwen2.5's logits: 311 MB
VERIFY_BYTES_PER_LOGIT = 16  # the static logits (4 bytes each) and what the head leaves in the graphs' pool


def verify_token_buckets(max_tokens: int) -> list[int]:
    """Token counts that get verification graphs: 8, 16, 32, ... below `max_tokens`, and `max_tokens` itself."""
    return doubling_buckets(SMALLEST_VERIFY_BUCKET, max_tokens)


class VerifyStepGraphs(MixedStepGraphs):
    """Step 12's mixed forward with small token buckets and every token's output: one graph per token bucket,
    row bucket and mode. When every row is greedy, each token's greedy token, found as the decode graphs find
    theirs (`greedy_tokens`), so that a verification row and a decode step break a near-tie alike, and no logits
    are written; when some row samples, every token's logits, for rejection sampling after the replay."""

    name = "verification"
    outputs = (GREEDY, LOGITS)  # no sampling inside: a sampled row's proposals are checked against its logits

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: AttentionBackend, max_model_len: int,
                 dummy_block: int, max_tokens: int, max_rows: int, capture: bool) -> None:
        self.greedy = torch.zeros(max_tokens, dtype=torch.long, device=model.device)
        super().__init__(model, cache, backend, max_model_len, dummy_block, max_tokens, max_rows, capture)

    @staticmethod
    def token_buckets_for(max_tokens: int) -> list[int]:
        return verify_token_buckets(max_tokens)

    @staticmethod
    def logit_rows(max_tokens: int, max_rows: int) -> int:
        return max_tokens  # every token's

    def write_outputs(self, hidden: torch.Tensor, tokens: int, rows: int, output: str) -> None:
        if output == LOGITS:
            self.logits[:tokens] = self.model.compute_logits(hidden)
        else:
            self.greedy[:tokens] = self.greedy_tokens(hidden)

    def run(self, chunks: Sequence[MixedChunk], output: str) -> torch.Tensor:
        """Replay (or run eagerly) the step; its tokens' outputs laid end to end: the logits [tokens, vocab] for
        LOGITS, each token's greedy token [tokens] for GREEDY."""
        tokens, rows = self.place(chunks)
        self.replay(chunks, tokens, rows, output)
        return (self.logits if output == LOGITS else self.greedy)[: sum(len(c.token_ids) for c in chunks)]
