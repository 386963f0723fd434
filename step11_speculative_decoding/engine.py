"""Step 11: speculative decoding. A decoder's next few tokens are guessed cheaply and checked in one forward,
so one read of the weights can yield several tokens, with the output plain decoding would give.

Against step 10, `SpeculativeEngine` changes one thing in a step: after step 09's scheduler has placed the
decoders and the prefill chunks, each decoder with proposals (`proposers.py`) becomes a verification chunk:
its last token and the k proposals, one row of k + 1 tokens over its cached prefix, which step 09's mixed
forward already computes (a prompt chunk is the same shape). The target's logits at all k + 1 positions
decide how many proposals to keep (`verify.py`); the request's K/V past the last kept one is simply
overwritten later, and its blocks past its new end go back.

How many proposals to check is a rule (`proposal_counts`): a proposal costs the step one more token, and is
worth it only if it is likely enough to be kept. Speculation uses only what a step leaves: the budget's tokens
after the decoders and the chunks, and free blocks (it never preempts anyone for a guess).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field

import torch

from common.loading import LoadedModel
from common.request import RequestOutput
from common.sampling import SamplingTensors
from step02_paged_kv.kv_cache import PagedKVCache
from step09_chunked_prefill.engine import Chunk, ChunkedPrefillEngine
from step10_prefix_caching.engine import PrefixCachingEngine
from step11_speculative_decoding import verify as verification
from step11_speculative_decoding.config import SpeculativeEngineConfig
from step11_speculative_decoding.proposers import NgramProposer, Proposal, Proposer
from step11_speculative_decoding.request import SpeculativeRequest
from step11_speculative_decoding.verify import rejection_sample, target_probabilities

log = logging.getLogger(__name__)

# What a step costs, in decode steps. A plain step of T tokens costs 1 + T x decode token cost; a step that verifies
# n proposals takes the verification path and costs 1 + step cost + (T + n) x token cost. Measured by
# `bench_oracle.py --token-cost 0 --step-cost 0` (every step verifies), fitted as a line in the step's tokens:
# - on the H200 (results/gpu/speculative-verify-step.json, a 7B model): a decode step takes 3.9 ms and 0.015 ms
#   more per decoder; a verification step 4.7 ms and 0.047 ms per token (its rows run as a prefill of all their
#   tokens, not through the decode graphs' kernels), so a step that verifies at all costs 0.2 more, and its tokens
#   0.012 each against 0.004 in a decode step;
# - on a CPU both steps are the same eager forward: a token costs the same in both, about a tenth of a step on
#   the lesson's 2-core CPU (results/cpu/speculative-oracle.json: 2 proposals 1.16x, 4 proposals 1.38x).
DEFAULT_TOKEN_COST = {"cuda": 0.012, "cpu": 0.1}
DEFAULT_DECODE_TOKEN_COST = {"cuda": 0.004}  # a CPU's: its token cost
DEFAULT_STEP_COST = {"cuda": 0.2, "cpu": 0.0}
ACCEPTANCE_WEIGHT = 0.2  # of each new outcome (kept 1, rejected 0) in a request's running acceptance estimate
PROBE_SHARE = 0.01  # of the time, at most, spent checking one proposal of requests the rule leaves out


@dataclass
class SpeculativeChunk(Chunk):
    """Step 09's chunk, part of a prompt or a plain decoder's token, as a speculative step reads every chunk:
    it proposes nothing, and needs the logits of its last token if it samples. `VerifyChunk` answers otherwise."""

    @property
    def proposals(self) -> list[int]:
        return []

    @property
    def token_ids(self) -> list[int]:
        return ChunkedPrefillEngine.chunk_token_ids(self)

    @property
    def logit_rows(self) -> range:
        """Its tokens (0: its first) whose logits the step needs."""
        return range(self.num_tokens - 1, self.num_tokens) if self.samples else range(0)


@dataclass
class VerifyChunk(SpeculativeChunk):
    """A decoder's last token and the tokens proposed after it: `1 + len(proposals)` tokens from position
    `start` (= its length - 1), every one of which gives logits."""

    proposal: Proposal = field(default_factory=lambda: Proposal([]))

    @property
    def samples(self) -> bool:
        return True

    @property
    def proposals(self) -> list[int]:
        return self.proposal.tokens

    @property
    def token_ids(self) -> list[int]:
        return [self.request.all_token_ids[-1], *self.proposals]

    @property
    def logit_rows(self) -> range:
        return range(self.num_tokens)


class SpeculativeEngine(PrefixCachingEngine):
    config_class = SpeculativeEngineConfig
    request_class = SpeculativeRequest
    chunk_class = SpeculativeChunk

    def __init__(self, loaded: LoadedModel, config: SpeculativeEngineConfig) -> None:
        self.draft: LoadedModel | None = None  # --speculative-method draft: loaded before the pool is sized
        super().__init__(loaded, config)
        self.check_speculation(config)
        self.proposer: Proposer | None = self.create_proposer(config) if config.speculative_tokens else None
        kind = "cuda" if self.device.type == "cuda" else "cpu"
        self.token_cost = (DEFAULT_TOKEN_COST[kind] if config.speculative_token_cost is None
                           else config.speculative_token_cost)
        self.step_cost = DEFAULT_STEP_COST[kind] if config.speculative_step_cost is None else config.speculative_step_cost
        self.decode_token_cost = (DEFAULT_DECODE_TOKEN_COST.get(kind, self.token_cost)
                                  if config.speculative_decode_token_cost is None
                                  else config.speculative_decode_token_cost)
        if min(self.token_cost, self.step_cost, self.decode_token_cost) < 0:
            raise ValueError("--speculative-token-cost, --speculative-decode-token-cost and --speculative-step-cost "
                             "must be at least 0")
        self.proposed_tokens = 0  # proposals verified
        self.accepted_tokens = 0  # of those, kept
        self.verify_rows = 0  # verification chunks run: each emits 1 + its kept proposals
        if self.proposer is not None:
            print(f"[{type(self).__name__}] {self.describe_speculation()}", flush=True)  # said at start-up

    @staticmethod
    def check_speculation(config: SpeculativeEngineConfig) -> None:
        if config.speculative_tokens < 0:
            raise ValueError(f"--speculative-tokens must be 0 (off) or more, got {config.speculative_tokens}")
        if config.speculative_method not in ("ngram", "draft"):
            raise ValueError(f"--speculative-method must be ngram or draft, got {config.speculative_method!r}")
        if config.draft_model is not None and config.speculative_method != "draft":
            raise ValueError("--draft-model is used only with --speculative-method draft: add that, or drop the model")

    def blocks_in_budget(self, config: SpeculativeEngineConfig) -> int:
        """Step 09's budget, shared with a draft model: its weights are loaded first (the free memory measured is
        what they leave), and its pool has as many blocks as ours, so each block of the budget pays for both."""
        if config.speculative_method != "draft" or not config.speculative_tokens:
            return super().blocks_in_budget(config)
        from step11_speculative_decoding.draft import load_draft  # loads a second model

        self.draft = load_draft(config, self.device, self.model.dtype)
        ours = PagedKVCache.bytes_per_block(self.model.config, config.block_size, self.model.dtype)
        theirs = PagedKVCache.bytes_per_block(self.draft.model.config, config.block_size, self.model.dtype)
        return max(1, super().blocks_in_budget(config) * ours // (ours + theirs))

    def create_proposer(self, config: SpeculativeEngineConfig) -> Proposer:
        if config.speculative_method == "ngram":
            return NgramProposer(config.speculative_tokens)
        from step11_speculative_decoding.draft import DraftProposer  # loads a second model, if not loaded yet

        return DraftProposer.create(self, config, self.draft)

    def describe_speculation(self) -> str:
        return (f"speculation: up to {self.config.speculative_tokens} {self.config.speculative_method} proposals "
                f"per decoder, checked where they pay for what they cost, in decode steps: {self.step_cost:g} for a "
                f"step that verifies, {self.token_cost:g} for each of its tokens ({self.decode_token_cost:g} in a "
                f"decode step)")

    # ----- scheduling: proposals in what the step leaves -----------------------------------------------------

    def schedule(self) -> tuple[list[SpeculativeRequest], list[Chunk]]:
        decoders, chunks = super().schedule()
        if self.proposer is None or not decoders:
            return decoders, chunks
        step_tokens = len(decoders) + sum(c.num_tokens for c in chunks)
        ordered = sorted(decoders, key=self.importance)
        limits = [self.proposer.most(r, self.proposal_room(r)) for r in ordered]
        counts = self.proposal_counts(ordered, limits, step_tokens)
        chosen = [(r, n) for r, n in zip(ordered, counts, strict=True) if n]
        proposals = self.proposer.propose([r for r, _ in chosen], [n for _, n in chosen]) if chosen else []
        plain, verifying = [r for r, n in zip(ordered, counts, strict=True) if not n], []
        for (request, _), proposal in zip(chosen, proposals, strict=True):
            proposal = self.reserve_proposal_blocks(request, proposal)
            if proposal.tokens:
                verifying.append(VerifyChunk(request, request.num_tokens - 1, 1 + len(proposal.tokens), proposal))
            else:
                self.proposer.rollback(request)  # no room to check them: the proposer forgets what it ran ahead
                plain.append(request)
        for request in plain:
            request.steps_unchecked += 1
        return plain, verifying + chunks

    def proposal_room(self, request: SpeculativeRequest) -> int:
        """The most tokens it may propose: k, and one fewer than it may still emit (the step's own token)."""
        if request.params.needs_logits:
            # Penalties depend on each token before, and log-probabilities come from the sampler: it decodes one
            # token a step, through the sampler.
            return 0
        return self.room_to_speculate(request)

    def room_to_speculate(self, request: SpeculativeRequest) -> int:
        return min(self.config.speculative_tokens, request.max_total_tokens - request.num_tokens - 1)

    # The rule, on its own so that the step's economics read in a few lines (exercise 11-proposal-counts).
    def proposal_counts(self, decoders: list[SpeculativeRequest], limits: list[int], step_tokens: int) -> list[int]:
        """How many proposals to check for each decoder (at most `limits[i]`) in a step that already computes
        `step_tokens` tokens. A decoder's j-th proposal is kept with chance a^j (a: its `acceptance`), so n
        proposals, the most likely first, add their chances to the step's tokens: E = decoders + the sum. The
        plain step costs 1 + d x step_tokens, one that verifies 1 + s + c x (step_tokens + n) (d:
        `decode_token_cost`, s: `step_cost`, c: `token_cost`). Take the n that gives the most tokens per cost, 0 if
        none beats the plain step; stop at the token limit. A decoder left out for `probe_interval` steps checks
        one proposal anyway, so that its estimate can recover."""
        c, s, d = self.token_cost, self.step_cost, self.decode_token_cost
        room = max(0, self.speculation_token_limit() - step_tokens)
        plain_rate = len(decoders) / (1 + d * step_tokens)
        chances = []  # the common case of a large batch, where no proposal could pay: no sort, only the probes
        if self.may_pay(decoders, room, step_tokens, plain_rate):
            chances = sorted(((r.acceptance**j, i) for i, r in enumerate(decoders) for j in range(1, limits[i] + 1)),
                             key=lambda chance_and_row: -chance_and_row[0])[:room]
        expected, best, best_rate = float(len(decoders)), 0, plain_rate
        for n, (chance, _) in enumerate(chances, start=1):
            expected += chance
            rate = expected / (1 + s + c * (step_tokens + n))
            if rate > best_rate:
                best, best_rate = n, rate
        counts = [0] * len(decoders)
        for _, i in chances[:best]:
            counts[i] += 1
        every = self.probe_interval(len(decoders), step_tokens)
        for i, request in enumerate(decoders):
            if not counts[i] and limits[i] and request.steps_unchecked >= every and best < room:
                counts[i], best = 1, best + 1
        return counts

    def may_pay(self, decoders: list[SpeculativeRequest], room: int, step_tokens: int, plain_rate: float) -> bool:
        """Whether some number of proposals, 1 to `room`, could beat the plain step were each as likely as the
        best decoder's first: that rate is a ratio of two lines in n, so its best is at n = 1 or n = room."""
        best = max((r.acceptance for r in decoders), default=0.0)
        return any((len(decoders) + n * best) / (1 + self.step_cost + self.token_cost * (step_tokens + n)) > plain_rate
                   for n in {1, room} if 0 < n <= room)

    def probe_interval(self, decoders: int, step_tokens: int) -> int:
        """How many steps a decoder the rule leaves out waits before it checks one proposal anyway: what a step in
        which every decoder probes costs beyond the plain step, spread so that probes take at most PROBE_SHARE of
        the time (on the H200, 22 steps at batch 1 and 118 at batch 64)."""
        plain = 1 + self.decode_token_cost * step_tokens
        probing = 1 + self.step_cost + self.token_cost * (step_tokens + decoders)
        return max(1, math.ceil((probing / plain - 1) / PROBE_SHARE))

    def speculation_token_limit(self) -> int:
        """The most tokens a step may reach with its proposals: the token budget."""
        return self.token_budget

    def reserve_proposal_blocks(self, request: SpeculativeRequest, proposal: Proposal) -> Proposal:
        """Take the blocks the proposal's positions need from the free ones; cut it where the pool runs short."""
        size = self.cache.block_size
        fits = (len(request.block_table) + self.allocator.num_free) * size - request.num_tokens
        if fits < len(proposal.tokens):
            proposal = Proposal(proposal.tokens[: max(0, fits)],
                                None if proposal.probs is None else proposal.probs[: max(0, fits)])
        if proposal.tokens:
            # Positions up to num_tokens - 1 + len(proposals): the last token's, then one per proposal.
            more = self.cache.blocks_for(request.num_tokens + len(proposal.tokens)) - len(request.block_table)
            request.block_table = request.block_table + self.allocator.allocate(max(0, more))
        return proposal

    # ----- running the model: verification rows --------------------------------------------------------------

    @staticmethod
    def chunk_token_ids(chunk: SpeculativeChunk) -> list[int]:
        return chunk.token_ids

    def forward_mixed(self, chunks: list[SpeculativeChunk]) -> list[RequestOutput]:
        if not any(c.proposals for c in chunks):
            return super().forward_mixed(chunks)
        sampling = [c for c in chunks if c.samples]
        emitted = self.compute_verified(chunks)
        for chunk in chunks:
            if not chunk.proposals:  # a verification's K/V counts once its proposals are kept (`emit`)
                self.mark_computed(chunk.request, chunk.end)
        self.prefill_chunks += len(chunks) - len(sampling)
        return [self.emit(chunk, tokens) for chunk, tokens in zip(sampling, emitted, strict=True)]

    @torch.inference_mode()
    def compute_verified(self, chunks: list[SpeculativeChunk]) -> list[list[int]]:
        """The forward, then the tokens each sampling chunk emits (`tokens_from_logits`)."""
        hidden = self.run_chunks(chunks)
        return self.tokens_from_logits(chunks, self.model.compute_logits(hidden[self.logit_rows(chunks)]))

    @staticmethod
    def logit_rows(chunks: list[SpeculativeChunk]) -> list[int]:
        """The token rows whose logits a step needs: every token of a verification chunk, the last token of
        any other chunk that samples."""
        firsts = itertools.accumulate((c.num_tokens for c in chunks), initial=0)
        return [first + row for first, chunk in zip(firsts, chunks) for row in chunk.logit_rows]

    def tokens_from_logits(self, chunks: list[SpeculativeChunk], logits: torch.Tensor) -> list[list[int]]:
        """From the logits of `logit_rows`, the tokens each sampling chunk emits: the kept proposals and one
        more for a verification chunk; one, sampled as step 09 does, for a chunk that ends a prompt or a
        plain decoder."""
        verifying, others, verify_rows, other_rows, row = [], [], [], [], 0
        for chunk in chunks:
            rows = range(row, row + len(chunk.logit_rows))
            if chunk.proposals:
                verifying.append(chunk)
                verify_rows += rows
            elif chunk.samples:
                others.append(chunk)
                other_rows += rows
            row = rows.stop
        verified = iter(self.verify(verifying, logits[verify_rows]) if verifying else [])
        sampled = iter(self.sample(logits[other_rows], [c.request for c in others]) if others else [])
        return [next(verified) if c.proposals else [next(sampled)] for c in chunks if c.samples]

    def verify(self, chunks: list[VerifyChunk], logits: torch.Tensor) -> list[list[int]]:
        """The tokens each verification chunk emits, from the target's logits at its 1 + k positions (the
        chunks' rows laid end to end in `logits`), with one wait for the device for all of them."""
        firsts = list(itertools.accumulate((c.num_tokens for c in chunks), initial=0))
        greedy = [i for i, c in enumerate(chunks) if c.request.params.greedy]
        drawn = [i for i, c in enumerate(chunks) if not c.request.params.greedy]
        argmax = logits.argmax(-1)
        sampled_tokens, sampled_counts = self.rejection_sample([chunks[i] for i in drawn], logits, firsts, drawn)
        argmax, sampled_tokens, sampled_counts = argmax.tolist(), sampled_tokens.tolist(), sampled_counts.tolist()
        emitted: list[list[int]] = [[] for _ in chunks]
        for i in greedy:
            emitted[i] = verification.accept_greedy(chunks[i].proposals, argmax[firsts[i] : firsts[i + 1]])
        for row, i in enumerate(drawn):
            emitted[i] = sampled_tokens[row][: sampled_counts[row]]
        for chunk, tokens in zip(chunks, emitted, strict=True):
            self.record_outcome(chunk.request, len(chunk.proposals), len(tokens) - 1)
        return emitted

    def rejection_sample(self, chunks: list[VerifyChunk], logits: torch.Tensor, firsts: list[int], rows: list[int]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """`verify.rejection_sample` over the sampled chunks, their proposals padded to the longest."""
        if not chunks:
            return torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        k = max(len(c.proposals) for c in chunks)
        vocab, device = logits.shape[-1], logits.device
        positions = [[min(firsts[i] + j, firsts[i + 1] - 1) for j in range(k + 1)] for i in rows]
        params = SamplingTensors.build([c.request.params for c in chunks],
                                       [len(c.request.output_token_ids) for c in chunks], vocab, device)
        target = target_probabilities(logits[torch.tensor(positions, device=device)].float(), params)
        proposals = torch.tensor([c.proposals + [0] * (k - len(c.proposals)) for c in chunks], device=device)
        draft = None
        if any(c.proposal.probs is not None for c in chunks):
            draft = torch.nn.functional.one_hot(proposals, vocab).float()
            for row, c in enumerate(chunks):
                if c.proposal.probs is not None:
                    draft[row, : len(c.proposals)] = c.proposal.probs.float()
        counts = torch.tensor([len(c.proposals) for c in chunks], device=device)
        return rejection_sample(target, draft, proposals, counts, params.seeds, params.positions)

    def record_outcome(self, request: SpeculativeRequest, proposed: int, kept: int) -> None:
        """Count the verification, and move the request's acceptance estimate toward what it saw: each kept
        proposal an outcome of 1, the first rejected one (if any) of 0; those after it were never tested."""
        self.verify_rows += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += kept
        for outcome in [1.0] * kept + [0.0] * (kept < proposed):
            request.acceptance += ACCEPTANCE_WEIGHT * (outcome - request.acceptance)
        request.steps_unchecked = 0

    # ----- emitting several tokens, rolling back the rest ----------------------------------------------------

    def emit(self, chunk: SpeculativeChunk, tokens: list[int]) -> RequestOutput:
        """Append the chunk's tokens one by one (a stop token, a stop string or `max_tokens` among them ends
        the request there); then the request's cached length is its new length less the newest token, and
        the blocks past it go back to the pool."""
        request = chunk.request
        if not chunk.proposals:
            return self.process_tokens([request], tokens)[0]
        outputs = []
        try:
            for token_id in tokens:
                outputs.append(request.append_token(token_id))
                if request.finished:
                    break
        except Exception as err:  # noqa: BLE001 - as `Engine.process_tokens`: this request ends alone
            log.exception("request %s failed", request.request_id)
            outputs.append(request.fail(err))
        if request.finished:
            self.finish(request)
        else:
            self.mark_computed(request, request.num_tokens - 1)  # the kept proposals' K/V, now verified
            keep = self.cache.blocks_for(request.num_tokens)
            self.allocator.free(request.block_table[keep:])
            request.block_table = request.block_table[:keep]
            assert self.proposer is not None
            self.proposer.rollback(request)
        return RequestOutput(request.request_id, [t for o in outputs for t in o.new_token_ids],
                             "".join(o.new_text for o in outputs), outputs[-1].finished, outputs[-1].finish_reason,
                             request.listener, error=outputs[-1].error)

    # ----- the proposer's state goes where the request's does --------------------------------------------------

    def preempt(self, victim: SpeculativeRequest) -> None:
        super().preempt(victim)
        if self.proposer is not None:
            self.proposer.release(victim)  # a draft's blocks too: it catches up again once the request is back

    def free_request(self, request: SpeculativeRequest) -> None:
        super().free_request(request)
        if self.proposer is not None:
            self.proposer.release(request)

    # ----- reports ---------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        rows = self.verify_rows
        return super().stats() | {"speculative_proposed_total": self.proposed_tokens,
                                  "speculative_accepted_total": self.accepted_tokens,
                                  "speculative_verify_rows_total": rows,
                                  "speculative_acceptance_rate": self.accepted_tokens / max(1, self.proposed_tokens),
                                  "speculative_tokens_per_verify_row": (rows + self.accepted_tokens) / max(1, rows)}

    def memory_report(self) -> str:
        if not self.verify_rows:
            return super().memory_report()
        rate = self.accepted_tokens / max(1, self.proposed_tokens)
        return (f"{super().memory_report()}\nspeculation: {self.accepted_tokens} of {self.proposed_tokens} proposals "
                f"kept ({rate:.0%}), {(self.verify_rows + self.accepted_tokens) / self.verify_rows:.2f} tokens "
                f"per verification row")
