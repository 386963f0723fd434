"""Step 16: structured output. Text that always parses, because no token that would break it is ever drawn.

A request may name a format (`SamplingParams.structured`: any JSON object, JSON valid against a schema, a regular
expression, a list of choices). Against step 15, `StructuredOutputEngine` changes three things:
- each such request gets a matcher of its grammar when it arrives (`check_request`): a format that cannot be
  compiled is refused there, naming what is wrong;
- before its token is drawn, its row of logits keeps only the tokens the matcher allows (`sample`: the batch's
  bitmasks, filled on the host, applied on the device in one set of ops; the other rows untouched);
- each drawn token advances its matcher (`ConstrainedRequest.append_token`), and an output the grammar allows
  nothing more after (a closed object, a whole choice) finishes with `stop`.
Under speculative decoding (step 11) a proposal the grammar forbids is cut before it is checked, and each checked
position's logits are masked as the grammar stands there, so the output is the same with speculation on and off.
The mask for a token needs the token before it on the host. Step 14 launches a decode step before the host has read
the tokens of the one before; for a batch with a grammar it launches the forward alone, and its tokens are drawn once
the host has read the step before's and filled the masks (`MaskedDraw`), while the GPU still runs that forward.
Each matcher reads its token before the host turns the tokens into text, and the next step's masks are filled by
llguidance's threads meanwhile (`fill_ahead`), outside Python's lock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from common.loading import LoadedModel
from common.request import FinishReason, Request, RequestOutput, RequestStatus
from common.sampling import TokenLogprob, to_device
from step11_speculative_decoding.engine import VerifyChunk
from step11_speculative_decoding.proposers import Proposal
from step11_speculative_decoding.request import SpeculativeRequest
from step12_cuda_graph.decode_graphs import PendingTokens
from step14_overlap_scheduling.engine import LaunchAheadBatch, LaunchedDecode, PendingLogprobs
from step15_batch_invariant.engine import BatchInvariantEngine, BatchInvariantEngineConfig
from step16_structured_output.bitmask import BITS, apply_token_bitmask
from step16_structured_output.grammar import GrammarCompiler, GrammarError, GrammarMatcher


@dataclass(eq=False)
class ConstrainedRequest(SpeculativeRequest):
    matcher: GrammarMatcher | None = None  # where its output is in its grammar; None: free text
    # A token the matcher has read before `append_token` (`read_ahead`), and whether the grammar ended there.
    token_read: int | None = None
    complete_after_read: bool = False

    def read_ahead(self, token_id: int) -> None:
        """The grammar's part of appending a token, done for a whole batch before the text's part. A token the
        grammar refuses is left for `append_token`, which reads it again and fails the request."""
        assert self.matcher is not None
        try:
            self.matcher.advance(token_id)
        except GrammarError:
            return
        self.token_read, self.complete_after_read = token_id, self.matcher.complete

    def append_token(self, token_id: int) -> RequestOutput:
        if self.matcher is None:
            return super().append_token(token_id)
        if self.token_read == token_id:  # read ahead: the matcher may be in llguidance's threads now, untouched
            self.token_read, complete = None, self.complete_after_read
        else:
            self.matcher.advance(token_id)
            complete = self.matcher.complete
        out = super().append_token(token_id)
        if out.finished or not complete:
            return out
        # The grammar allows nothing more: done, as at a stop string, with this token's text kept.
        self.finish_reason, self.status = FinishReason.STOP, RequestStatus.FINISHED
        self.text += self.detokenizer.flush()
        return replace(out, new_text=out.new_text + self._take_new_text(), finished=True,
                       finish_reason=FinishReason.STOP)


class MaskedDraw:
    """A constrained batch's step, launched: its logits are on their way, its tokens not drawn yet. Their masks need
    the tokens of the step before on the host; `draw` queues the masked sampler once they are (once only). It stands
    for both the step's tokens and its log-probabilities (`LaunchedDecode`), which come from the same draw."""

    def __init__(self, draw: Callable[[], tuple[PendingTokens, PendingLogprobs | None]], rows: int) -> None:
        self.queue_draw, self.rows = draw, rows
        self.drawn: tuple[PendingTokens, PendingLogprobs | None] | None = None

    def draw(self) -> tuple[PendingTokens, PendingLogprobs | None]:
        if self.drawn is None:
            self.drawn = self.queue_draw()
        return self.drawn

    def wait(self) -> list[int]:
        return self.draw()[0].wait()

    def records(self) -> list[TokenLogprob | None]:
        logprobs = self.draw()[1]
        return logprobs.records() if logprobs is not None else [None] * self.rows


@dataclass
class StructuredOutputEngineConfig(BatchInvariantEngineConfig):
    pass


class StructuredOutputEngine(BatchInvariantEngine):
    config_class = StructuredOutputEngineConfig
    request_class = ConstrainedRequest
    serves_structured_output = True

    def __init__(self, loaded: LoadedModel, config: StructuredOutputEngineConfig) -> None:
        super().__init__(loaded, config)
        self.grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
        # The masks of the step launched ahead, being filled while the host turns this step's tokens into text.
        self.filling: tuple[list[ConstrainedRequest], Future[torch.Tensor]] | None = None
        self.fill_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        if self.device.type == "cuda":  # compile the masks' kernel now, not while the first constrained request waits
            vocab = self.model.config.vocab_size
            apply_token_bitmask(torch.zeros(1, vocab, device=self.device),
                                torch.full((1, -(-vocab // BITS)), -1, dtype=torch.int32, device=self.device),
                                torch.zeros(1, dtype=torch.int64, device=self.device))

    def check_request(self, request: Request) -> None:
        super().check_request(request)
        assert isinstance(request, ConstrainedRequest)
        if request.params.structured is not None:
            request.matcher = self.grammars.matcher(request.params.structured)  # a GrammarError refuses it

    def sample(self, logits: torch.Tensor, requests: list[ConstrainedRequest]) -> list[int]:
        """Step 15's draw, after every constrained row's logits keep only what its grammar allows next."""
        constrained = [row for row, request in enumerate(requests) if request.matcher is not None]
        return super().sample(self.masked(logits, requests, constrained), requests)

    def masked(self, logits: torch.Tensor, requests: list[ConstrainedRequest], rows: list[int]) -> torch.Tensor:
        """The logits with each of `rows` keeping only what its request's grammar allows next (the bitmasks filled
        on the host, applied on the device in one set of ops); the other rows as they are."""
        if not rows:
            return logits
        bitmask = self.masks_for([requests[row] for row in rows])  # pinned where there is a GPU
        return apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True),
                                   to_device(rows, torch.int64, logits.device))

    def masks_for(self, requests: list[ConstrainedRequest]) -> torch.Tensor:
        """The requests' masks, one row each: those `fill_ahead` filled where it did (picked in order), the others
        filled now."""
        filled = self.settle_fill()
        if filled is not None and all(r in filled for r in requests):
            bitmask, rows = filled[requests[0]][0], [filled[r][1] for r in requests]
            if rows == list(range(len(bitmask))):
                return bitmask
            picked = torch.empty((len(rows), bitmask.shape[1]), dtype=bitmask.dtype, pin_memory=bitmask.is_pinned())
            return torch.index_select(bitmask, 0, torch.tensor(rows), out=picked)
        return self.grammars.bitmask([r.matcher for r in requests])

    def settle_fill(self) -> dict[ConstrainedRequest, tuple[torch.Tensor, int]] | None:
        """Wait for the masks being filled ahead, if any: after this the matchers are the host's again. Each
        request they were filled for, with the bitmask and its row."""
        if self.filling is None:
            return None
        requests, future = self.filling
        self.filling = None
        bitmask = future.result()
        return {request: (bitmask, row) for row, request in enumerate(requests)}

    def process_tokens(self, requests: Sequence[ConstrainedRequest], token_ids: Sequence[int]
                       ) -> list[RequestOutput]:
        """Step 15's, with the grammar's part first: each constrained request's matcher reads its token, and the
        masks of the step launched ahead are filled by llguidance's threads (outside Python's lock) while the host
        turns the tokens into text, rather than after."""
        for request, token_id in zip(requests, token_ids, strict=True):
            if request.matcher is not None:
                request.read_ahead(token_id)
        self.fill_ahead()
        return super().process_tokens(requests, token_ids)

    def fill_ahead(self) -> None:
        """Start filling the masks of the constrained step launched ahead: its requests whose matcher has read this
        step's token and whose grammar goes on."""
        self.settle_fill()
        if self.ahead is None or not isinstance(self.ahead.tokens, MaskedDraw):
            return
        requests = [r for r in self.ahead.requests
                    if r.matcher is not None and r.token_read is not None and not r.complete_after_read]
        if requests:
            self.filling = requests, self.fill_thread.submit(self.grammars.bitmask, [r.matcher for r in requests])

    # ----- speculative decoding under a grammar --------------------------------------------------------------

    def proposal_room(self, request: ConstrainedRequest) -> int:
        """Step 11's, and a request whose only use of the sampler is its grammar may propose too: its proposals are
        cut where the grammar forbids one (`reserve_proposal_blocks`), and checked against masked logits."""
        params = request.params
        if request.matcher is not None and not params.adjusts_logits and params.logprobs is None:
            return self.room_to_speculate(request)
        return super().proposal_room(request)

    def reserve_proposal_blocks(self, request: ConstrainedRequest, proposal: Proposal) -> Proposal:
        if request.matcher is not None:
            self.settle_fill()
            allowed = request.matcher.allowed_prefix(proposal.tokens)
            proposal = Proposal(proposal.tokens[:allowed], None if proposal.probs is None else proposal.probs[:allowed])
        return super().reserve_proposal_blocks(request, proposal)

    def verify(self, chunks: list[VerifyChunk], logits: torch.Tensor) -> list[list[int]]:
        """Step 11's check, against each constrained chunk's logits masked as its grammar stands before each
        proposal and after the last: the tokens kept are those one-a-step decoding under the grammar would draw."""
        self.settle_fill()
        firsts = list(itertools.accumulate((c.num_tokens for c in chunks), initial=0))
        rows, masks = [], []
        for chunk, first in zip(chunks, firsts[:-1], strict=True):
            request = chunk.request
            if isinstance(request, ConstrainedRequest) and request.matcher is not None:
                masks.append(self.grammars.bitmasks_along(request.matcher, chunk.proposals))
                rows += range(first, first + len(chunk.proposals) + 1)
        if rows:
            bitmask = torch.cat(masks).pin_memory() if logits.is_cuda else torch.cat(masks)
            logits = apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True),
                                         to_device(rows, torch.int64, logits.device))
        return super().verify(chunks, logits)

    # ----- the overlapped decode step -----------------------------------------------------------------------

    def launch_rows(self, batch: LaunchAheadBatch, requests: list[ConstrainedRequest]
                    ) -> tuple[PendingTokens, PendingLogprobs | None]:
        """Step 14's launch, except for a batch with a grammar: its forward (the LOGITS graph) is launched now, and
        its tokens drawn later, by `draw_masked`, once the matchers have read the tokens of the step before."""
        if not any(r.matcher is not None for r in requests):
            return super().launch_rows(batch, requests)
        assert self.graphs is not None
        logits = self.graphs.logits_for(batch)
        draw = MaskedDraw(lambda: self.draw_masked(batch, requests, logits), len(requests))
        return draw, draw

    def draw_masked(self, batch: LaunchAheadBatch, requests: list[ConstrainedRequest], logits: torch.Tensor
                    ) -> tuple[PendingTokens, PendingLogprobs | None]:
        """A launched constrained batch's tokens, drawn on the device from its logits masked as each grammar now
        stands. The host has appended the tokens of the step before by now: none is pending on the device."""
        settled = replace(batch, previous_rows=[-1] * len(batch))
        # A request that finished meanwhile (its grammar ended, say) has a wasted row here: no mask for it.
        rows = [row for row, r in enumerate(requests) if r.matcher is not None and not r.finished]
        return self.draw_on_device(settled, requests, self.masked(logits, requests, rows))

    def launch_ahead(self, current: LaunchedDecode) -> LaunchedDecode | None:
        """Step 14's, once this step's tokens are drawn: the next step reads them on the device."""
        if isinstance(current.tokens, MaskedDraw):
            current.tokens.draw()
        return super().launch_ahead(current)
