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
The mask for a token needs the token before it on the host, so a constrained batch is not launched ahead (step 14).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from common.loading import LoadedModel
from common.request import FinishReason, Request, RequestOutput, RequestStatus
from step11_speculative_decoding.engine import VerifyChunk
from step11_speculative_decoding.proposers import Proposal
from step11_speculative_decoding.request import SpeculativeRequest
from step12_cuda_graph.engine import CudaGraphEngine
from step14_overlap_scheduling.engine import LaunchedDecode
from step15_batch_invariant.engine import BatchInvariantEngine, BatchInvariantEngineConfig
from step16_structured_output.bitmask import apply_token_bitmask
from step16_structured_output.grammar import GrammarCompiler, GrammarMatcher


@dataclass(eq=False)
class ConstrainedRequest(SpeculativeRequest):
    matcher: GrammarMatcher | None = None  # where its output is in its grammar; None: free text

    def append_token(self, token_id: int) -> RequestOutput:
        if self.matcher is None:
            return super().append_token(token_id)
        self.matcher.advance(token_id)
        out = super().append_token(token_id)
        if out.finished or not self.matcher.complete:
            return out
        # The grammar allows nothing more: done, as at a stop string, with this token's text kept.
        self.finish_reason, self.status = FinishReason.STOP, RequestStatus.FINISHED
        self.text += self.detokenizer.flush()
        return replace(out, new_text=out.new_text + self._take_new_text(), finished=True,
                       finish_reason=FinishReason.STOP)


@dataclass
class StructuredOutputEngineConfig(BatchInvariantEngineConfig):
    pass


class StructuredOutputEngine(BatchInvariantEngine):
    config_class = StructuredOutputEngineConfig
    request_class = ConstrainedRequest
    serves_structured_output = True

    def __init__(self, loaded: LoadedModel, config: StructuredOutputEngineConfig) -> None:
        super().__init__(loaded, config)
        self.grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)

    def check_request(self, request: Request) -> None:
        super().check_request(request)
        assert isinstance(request, ConstrainedRequest)
        if request.params.structured is not None:
            request.matcher = self.grammars.matcher(request.params.structured)  # a GrammarError refuses it

    def sample(self, logits: torch.Tensor, requests: list[ConstrainedRequest]) -> list[int]:
        """Step 15's draw, after every constrained row's logits keep only what its grammar allows next."""
        constrained = [row for row, request in enumerate(requests) if request.matcher is not None]
        if constrained:
            bitmask = self.grammars.bitmask([requests[row].matcher for row in constrained])
            rows = torch.tensor(constrained, device=logits.device)
            logits = apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows)
        return super().sample(logits, requests)

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
            allowed = request.matcher.allowed_prefix(proposal.tokens)
            proposal = Proposal(proposal.tokens[:allowed], None if proposal.probs is None else proposal.probs[:allowed])
        return super().reserve_proposal_blocks(request, proposal)

    def verify(self, chunks: list[VerifyChunk], logits: torch.Tensor) -> list[list[int]]:
        """Step 11's check, against each constrained chunk's logits masked as its grammar stands before each
        proposal and after the last: the tokens kept are those one-a-step decoding under the grammar would draw."""
        firsts = list(itertools.accumulate((c.num_tokens for c in chunks), initial=0))
        rows, masks = [], []
        for chunk, first in zip(chunks, firsts[:-1], strict=True):
            request = chunk.request
            if isinstance(request, ConstrainedRequest) and request.matcher is not None:
                masks.append(self.grammars.bitmasks_along(request.matcher, chunk.proposals))
                rows += range(first, first + len(chunk.proposals) + 1)
        if rows:
            bitmask = torch.cat(masks).to(logits.device, non_blocking=True)
            logits = apply_token_bitmask(logits, bitmask, torch.tensor(rows, device=logits.device))
        return super().verify(chunks, logits)

    # ----- the overlapped decode step -----------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, requests: list[ConstrainedRequest]) -> list[RequestOutput]:
        """A batch with a grammar decodes as step 12 does, its tokens drawn by `sample` once its logits are on the
        device: step 14 would draw them on the device without passing the host, where the masks are filled."""
        if any(r.matcher is not None for r in requests):
            self.launched_ahead = None  # none was launched for it (`launch_ahead`)
            return CudaGraphEngine.decode(self, requests)
        return super().decode(requests)

    def launch_ahead(self, current: LaunchedDecode) -> LaunchedDecode | None:
        """Step 14's, except for a batch with a grammar: its next mask needs this step's tokens on the host."""
        if any(r.matcher is not None for r in self.running):
            return None
        return super().launch_ahead(current)
