"""The draft-model proposer: a small model with the target's tokenizer runs a few tokens ahead of each request,
and the target checks its guesses.

A draft model is an engine inside the engine: it needs its own paged KV cache, kept in step with the target's
requests. Per request (on the request itself: `draft_table`, its draft blocks, and `draft_computed`, how many of
its first tokens the draft holds K/V for) the draft goes through one cycle per step that proposes:

    catch up   one forward over the tokens it has not seen, positions draft_computed .. num_tokens - 1: its
               last row gives the first proposal;
    run ahead  one one-token forward per further proposal, each feeding back the proposal before it (the last
               proposal is never fed back: the draft then holds K/V up to position num_tokens - 1 + count - 1);
    roll back  after the verification, its K/V stays valid exactly where the tokens did not change: up to the
               last kept proposal. The corrected token (or, with every proposal kept, the last proposal and
               the extra token) is caught up next time: one or two tokens, where the target's step has one.

Requests are batched at every position: the catch-up forward lays every request's unseen tokens end to end, as
step 09's mixed forward lays chunks; each run-ahead forward holds the requests that still want more.

Why a step-06 engine as the runner. Everything the draft needs to compute exists in step 06's
`PagedAttentionEngine`: the block pool, an allocator, an attention backend, `build_metadata` for several
requests' new tokens over their block tables, and the forward context. The proposer holds one, built on the
draft model, and never calls its scheduler: the target engine decides who runs, and the draft only computes.
(A subclass would inherit a scheduler to ignore; a class of our own would rebuild the pool, the allocator and
the backend.) Its pool has the target's block size and as many blocks as the target's pool; unlike the target,
the draft shares no cached prefix, and where its pool runs short a request simply gets fewer proposals.

Memory. On a GPU the target sizes its pool from the memory its weights leave free: the engine loads the draft
first and gives each pool the same number of blocks from one budget (`SpeculativeEngine.blocks_in_budget`). A
step's catch-up computes at most the target's token budget (a long prompt over several steps), so the draft's
forwards, smaller than the target's and never at the same time, fit in the worst step step 09 set aside.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from common.loading import LoadedModel, load_model
from common.sampling import SamplingTensors
from step06_paged_attention.engine import PagedAttentionEngine, PagedAttentionEngineConfig
from step09_chunked_prefill.engine import Chunk, ChunkedPrefillEngine
from step11_speculative_decoding.config import SpeculativeEngineConfig
from step11_speculative_decoding.proposers import Proposal
from step11_speculative_decoding.request import SpeculativeRequest
from step11_speculative_decoding.verify import draw, target_probabilities

# The draft's draws use another stream than the target's Gumbel noise and acceptance tests at the same (seed,
# position). With the target's own noise, a proposal would be correlated with the very numbers that judge it,
# and rejection sampling would no longer give the target's distribution.
DRAFT_STREAM = 0x27D4EB2F


def load_draft(config: SpeculativeEngineConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The model `--draft-model` names, on the target's device and in its dtype."""
    if not config.draft_model:
        raise ValueError("--speculative-method draft needs --draft-model: name a small model with the target's "
                         "tokenizer (for example tiny-llama), or use --speculative-method ngram")
    return load_model(config.draft_model, device, dtype, config.seed)


@dataclass
class DraftTable:
    """What step 06's `build_metadata` reads of a request, its `.block_table`: here the draft's blocks, so that
    the target request's own table is never touched."""

    block_table: list[int]


class DraftProposer:
    """Proposes each request's next tokens with a draft model (see the module's docstring)."""

    def __init__(self, runner: PagedAttentionEngine, catch_up_budget: int) -> None:
        self.runner = runner  # the draft model, its KV pool, allocator and attention backend
        self.model, self.cache, self.allocator = runner.model, runner.cache, runner.allocator
        # The most tokens one step's catch-up computes, the target's token budget: a long prompt is caught up in
        # chunks over several steps, as the target prefills it, never in one forward the budget did not measure.
        self.catch_up_budget = catch_up_budget

    @classmethod
    def create(cls, engine: ChunkedPrefillEngine, config: SpeculativeEngineConfig,
               draft: LoadedModel | None = None) -> DraftProposer:
        """A proposer running `draft` (loaded here from `config.draft_model` if not given), with a pool like the
        engine's: its block size, as many blocks."""
        if draft is None:
            draft = load_draft(config, engine.device, engine.model.dtype)
        ours, theirs = draft.model.config.vocab_size, engine.model.config.vocab_size
        if ours != theirs:
            raise ValueError(f"the draft model {config.draft_model!r} has a vocabulary of {ours} tokens and the "
                             f"target {theirs}: choose a --draft-model with the target's tokenizer")
        runner = PagedAttentionEngine(draft, PagedAttentionEngineConfig(
            device=str(engine.device), max_num_seqs=engine.config.max_num_seqs, block_size=engine.cache.block_size,
            num_blocks=engine.allocator.num_blocks, attn=engine.config.attn))
        return cls(runner, engine.token_budget)

    # ----- how many: what the draft's pool and context hold --------------------------------------------------

    def most(self, request: SpeculativeRequest, limit: int) -> int:
        return max(0, min(limit, self.room(request)))

    def room(self, request: SpeculativeRequest) -> int:
        """How many tokens the draft could propose for the request now: `n` of them need K/V for its first
        num_tokens + n - 1 tokens, in blocks it holds or free ones, at positions inside the draft's context."""
        slots = (len(request.draft_table) + self.allocator.num_free) * self.cache.block_size
        return min(slots, self.model.config.max_position_embeddings) - request.num_tokens + 1

    def reserve_blocks(self, request: SpeculativeRequest, count: int) -> int:
        """Give the request's draft table the blocks `count` proposals need; fewer proposals if the pool is short
        (several requests share it, and `most` answered for each alone)."""
        count = max(0, min(count, self.room(request)))
        if count:
            more = self.cache.blocks_for(request.num_tokens + count - 1) - len(request.draft_table)
            request.draft_table = request.draft_table + self.allocator.allocate(max(0, more))
        return count

    # ----- proposing: catch up, then run ahead ------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: list[SpeculativeRequest], counts: list[int]) -> list[Proposal]:
        counts = [self.reserve_blocks(r, n) for r, n in zip(requests, counts, strict=True)]
        counts = self.catch_up_in_budget(requests, counts)
        rows = [i for i, n in enumerate(counts) if n]  # the requests still drafting
        if not rows:
            return [Proposal([]) for _ in requests]
        logits = self.catch_up([requests[i] for i in rows])
        drafted: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []  # per position: rows, tokens, q
        for ahead in range(max(counts)):
            if ahead:
                still = [j for j, i in enumerate(rows) if counts[i] > ahead]
                rows = [rows[j] for j in still]
                logits = self.run_ahead([requests[i] for i in rows], drafted[-1][1][still], ahead)
            drafted.append((rows, *self.choose(logits, [requests[i] for i in rows], ahead)))
        for request, count in zip(requests, counts, strict=True):
            if count:
                request.draft_computed = request.num_tokens + count - 1
        return self.collect(requests, drafted)

    def catch_up_in_budget(self, requests: list[SpeculativeRequest], counts: list[int]) -> list[int]:
        """The counts once the catch-ups fit the budget: requests, in the engine's order, whose unseen tokens fit
        what is left keep theirs; the first that does not fit computes a chunk of what is left and proposes
        nothing this step (its blocks go back at the engine's `rollback`), and those after it wait."""
        left, counts = self.catch_up_budget, list(counts)
        for i, request in enumerate(requests):
            behind = request.num_tokens - request.draft_computed
            if not counts[i] or behind <= left:
                left -= behind if counts[i] else 0
                continue
            counts[i] = 0
            if left > 0:
                start = request.draft_computed
                chunk = Chunk(request, start, left)
                token_ids = torch.tensor(ChunkedPrefillEngine.chunk_token_ids(chunk), device=self.model.device)
                self.forward([request], token_ids, [left], [chunk.end])
                request.draft_computed, left = chunk.end, 0
        return counts

    def catch_up(self, requests: list[SpeculativeRequest]) -> torch.Tensor:
        """One forward over each request's tokens that the draft has not seen, laid end to end; the logits of
        each request's last token (its first proposal's distribution)."""
        chunks = [Chunk(r, r.draft_computed, r.num_tokens - r.draft_computed) for r in requests]
        token_ids = [t for c in chunks for t in ChunkedPrefillEngine.chunk_token_ids(c)]
        hidden = self.forward(requests, torch.tensor(token_ids, device=self.model.device),
                              [c.num_tokens for c in chunks], [c.end for c in chunks])
        last_rows = [end - 1 for end in itertools.accumulate(c.num_tokens for c in chunks)]
        return self.model.compute_logits(hidden[last_rows])

    def run_ahead(self, requests: list[SpeculativeRequest], fed: torch.Tensor, ahead: int) -> torch.Tensor:
        """Feed back each request's latest proposal (`fed`, still on the device: nothing waits for it), at
        position num_tokens - 1 + ahead; the logits after it, for its proposal number `ahead` (0: the first)."""
        seq_lens = [r.num_tokens + ahead for r in requests]
        return self.model.compute_logits(self.forward(requests, fed, [1] * len(requests), seq_lens))

    def forward(self, requests: list[SpeculativeRequest], token_ids: torch.Tensor, q_lens: list[int],
                seq_lens: list[int]) -> torch.Tensor:
        """The draft model over `q_lens[i]` new tokens of each request, ending at `seq_lens[i]`, with its K/V
        written into the draft's blocks: step 06's metadata and forward context, on the draft's tables."""
        tables = [DraftTable(r.draft_table) for r in requests]
        meta, positions = self.runner.build_metadata(tables, q_lens, seq_lens, is_prefill=max(q_lens) > 1)
        return self.model(token_ids, self.runner.context(meta, positions))

    def choose(self, logits: torch.Tensor, requests: list[SpeculativeRequest], ahead: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's proposal number `ahead` (0: the first): the argmax for a greedy request; for a sampling one a
        draw from the draft's own distribution under the request's temperature, top-k and top-p, at the output
        position the token would take. The distributions come back too (None if every row is greedy): rejection
        sampling weighs them against the target's."""
        greedy = logits.argmax(-1)
        if all(r.params.greedy for r in requests):
            return greedy, None
        rows = SamplingTensors.build([r.params for r in requests], [len(r.output_token_ids) + ahead for r in requests],
                                     logits.shape[-1], logits.device)
        probs = target_probabilities(logits[:, None], rows)[:, 0]
        return torch.where(rows.is_greedy, greedy, draw(probs, rows.seeds ^ DRAFT_STREAM, rows.positions)), probs

    @staticmethod
    def collect(requests: list[SpeculativeRequest], drafted: list[tuple[list[int], torch.Tensor, torch.Tensor | None]]
                ) -> list[Proposal]:
        """Each request's proposals from the per-position batches, after one wait for the device; a sampling
        request's with the distribution each was drawn from ([tokens, vocab])."""
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        flat = iter(torch.cat([t for _, t, _ in drafted]).tolist())
        for rows, _, q in drafted:
            for j, i in enumerate(rows):
                tokens[i].append(next(flat))
                if q is not None and not requests[i].params.greedy:
                    probs[i].append(q[j])
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs, strict=True)]

    # ----- the draft's K/V follows the request's tokens ------------------------------------------------------

    def rollback(self, request: SpeculativeRequest) -> None:
        """The request's tokens changed from position num_tokens - 1 on (a verification kept some proposals and
        replaced the next one): the draft's K/V before it is still the request's; its blocks past that go back."""
        request.draft_computed = min(request.draft_computed, request.num_tokens - 1)
        keep = self.cache.blocks_for(request.draft_computed)
        self.allocator.free(request.draft_table[keep:])
        request.draft_table = request.draft_table[:keep]

    def release(self, request: SpeculativeRequest) -> None:
        """Finished, aborted or preempted: every draft block goes back; the draft catches up from scratch if the
        request runs again."""
        self.allocator.free(request.draft_table)
        request.draft_table, request.draft_computed = [], 0
