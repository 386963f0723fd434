"""Step 11: speculative decoding. A decoder's next few tokens are guessed cheaply and checked in one forward,
so one read of the weights can yield several tokens, with the output plain decoding would give.

Against step 10, `SpeculativeEngine` changes one thing in a step: after step 09's scheduler has placed the
decoders and the prefill chunks, each decoder with proposals (`NgramProposer`: its last tokens found earlier
in its prompt or output) becomes a verification chunk: its last token and the k proposals, one row of k + 1
tokens over its cached prefix, which step 09's mixed forward already computes (a prompt chunk is the same
shape). The target's logits at all k + 1 positions decide how many proposals to keep (`verify.py`); the
request's K/V past the last kept one is simply overwritten later, and its blocks past its new end go back.

Speculation uses only what a step leaves: the budget's tokens after the decoders and the chunks, and free
blocks (it never preempts anyone for a guess).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from common.loading import LoadedModel
from common.request import RequestOutput
from common.sampling import SamplingTensors
from step09_chunked_prefill.engine import Chunk
from step10_prefix_caching.engine import PrefixCachedRequest, PrefixCachingEngine, PrefixCachingEngineConfig
from step11_speculative_decoding.proposers import NgramProposer
from step11_speculative_decoding.verify import accept_greedy, rejection_sample, target_probabilities


@dataclass
class SpeculativeEngineConfig(PrefixCachingEngineConfig):
    speculative_tokens: int = 0  # k, the most tokens proposed for a decoder per step; 0: no speculation
    speculative_method: str = "ngram"


@dataclass
class VerifyChunk(Chunk):
    """A decoder's last token and the tokens proposed after it: `1 + len(proposals)` tokens from position
    `start` (= its length - 1), every one of which gives logits."""

    proposals: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        return True

    @property
    def token_ids(self) -> list[int]:
        return [self.request.all_token_ids[-1], *self.proposals]


class SpeculativeEngine(PrefixCachingEngine):
    config_class = SpeculativeEngineConfig

    def __init__(self, loaded: LoadedModel, config: SpeculativeEngineConfig) -> None:
        super().__init__(loaded, config)
        if config.speculative_method != "ngram":
            raise ValueError(f"--speculative-method must be ngram, got {config.speculative_method!r}")
        self.proposer = NgramProposer(config.speculative_tokens) if config.speculative_tokens else None
        self.proposed_tokens = 0  # proposals verified
        self.accepted_tokens = 0  # of those, kept
        self.verify_rows = 0  # verification chunks run: each emits 1 + its kept proposals

    # ----- scheduling: proposals in what the step leaves -----------------------------------------------------

    def schedule(self) -> tuple[list[PrefixCachedRequest], list[Chunk]]:
        decoders, chunks = super().schedule()
        if self.proposer is None:
            return decoders, chunks
        left = self.token_budget - len(decoders) - sum(c.num_tokens for c in chunks)
        plain, verifying = [], []
        for request in sorted(decoders, key=self.importance):
            proposals = self.reserve_proposals(request, left)
            if proposals:
                verifying.append(VerifyChunk(request, request.num_tokens - 1, 1 + len(proposals), proposals))
                left -= len(proposals)
            else:
                plain.append(request)
        return plain, verifying + chunks

    def reserve_proposals(self, request: PrefixCachedRequest, left: int) -> list[int]:
        """The request's proposals, at most `left` of them and no more than it may still emit, with the blocks
        their positions need taken from the free ones; fewer where the pool runs short."""
        room = min(left, request.max_total_tokens - request.num_tokens - 1)
        if room <= 0:
            return []
        proposals = self.proposer.propose(request.all_token_ids)[:room]
        size = self.cache.block_size
        fits = (len(request.block_table) + self.allocator.num_free) * size - request.num_tokens
        proposals = proposals[: max(0, fits)]
        if proposals:
            # Positions up to num_tokens - 1 + len(proposals): the last token's, then one per proposal.
            more = self.cache.blocks_for(request.num_tokens + len(proposals)) - len(request.block_table)
            request.block_table = request.block_table + self.allocator.allocate(max(0, more))
        return proposals

    # ----- running the model: verification rows --------------------------------------------------------------

    @staticmethod
    def chunk_token_ids(chunk: Chunk) -> list[int]:
        return chunk.token_ids if isinstance(chunk, VerifyChunk) else PrefixCachingEngine.chunk_token_ids(chunk)

    def forward_mixed(self, chunks: list[Chunk]) -> list[RequestOutput]:
        if not any(isinstance(c, VerifyChunk) for c in chunks):
            return super().forward_mixed(chunks)
        sampling = [c for c in chunks if c.samples]
        emitted = self.compute_verified(chunks, sampling)
        for chunk in chunks:
            if not isinstance(chunk, VerifyChunk):
                self.mark_computed(chunk.request, chunk.end)
        self.prefill_chunks += len(chunks) - len(sampling)
        return [self.emit(chunk, tokens) for chunk, tokens in zip(sampling, emitted, strict=True)]

    @torch.inference_mode()
    def compute_verified(self, chunks: list[Chunk], sampling: list[Chunk]) -> list[list[int]]:
        """The forward, then the tokens each sampling chunk emits: one for a chunk that ends a prompt or a plain
        decoder (as step 09 samples it), the kept proposals and one more for a verification chunk."""
        hidden = self.run_chunks(chunks)
        ends = list(itertools.accumulate(c.num_tokens for c in chunks))
        rows = [range(ends[i] - c.num_tokens if isinstance(c, VerifyChunk) else ends[i] - 1, ends[i])
                for i, c in enumerate(chunks) if c.samples]
        logits = self.model.compute_logits(hidden[[r for span in rows for r in span]])
        firsts = list(itertools.accumulate((len(span) for span in rows[:-1]), initial=0))
        emitted: list[list[int]] = []
        for chunk, first, span in zip(sampling, firsts, rows, strict=True):
            chunk_logits = logits[first : first + len(span)]
            if isinstance(chunk, VerifyChunk):
                emitted.append(self.verify(chunk, chunk_logits))
            else:
                emitted.append(self.sample(chunk_logits, [chunk.request]))
        return emitted

    def verify(self, chunk: VerifyChunk, logits: torch.Tensor) -> list[int]:
        """The tokens a verification chunk emits, from the target's logits at its 1 + k positions."""
        request = chunk.request
        if request.params.greedy:
            tokens = accept_greedy(chunk.proposals, logits.argmax(-1).tolist())
        else:
            rows = SamplingTensors.build([request.params], [len(request.output_token_ids)], logits.shape[-1],
                                         logits.device)
            proposals = torch.tensor([chunk.proposals], device=logits.device)
            drawn, count = rejection_sample(target_probabilities(logits[None].float(), rows), None, proposals,
                                            torch.tensor([len(chunk.proposals)], device=logits.device),
                                            rows.seeds, rows.positions)
            tokens = drawn[0, : int(count)].tolist()
        self.verify_rows += 1
        self.proposed_tokens += len(chunk.proposals)
        self.accepted_tokens += len(tokens) - 1
        return tokens

    # ----- emitting several tokens, rolling back the rest ----------------------------------------------------

    def emit(self, chunk: Chunk, tokens: list[int]) -> RequestOutput:
        """Append the chunk's tokens one by one (a stop token, a stop string or `max_tokens` among them ends
        the request there); then the request's cached length is its new length less the newest token, and
        the blocks past it go back to the pool."""
        request = chunk.request
        if not isinstance(chunk, VerifyChunk):
            return self.process_tokens([request], tokens)[0]
        outputs = []
        for token_id in tokens:
            outputs.append(request.append_token(token_id))
            if request.finished:
                break
        if request.finished:
            self.finish(request)
        else:
            self.mark_computed(request, request.num_tokens - 1)  # the kept proposals' K/V, now verified
            keep = self.cache.blocks_for(request.num_tokens)
            self.allocator.free(request.block_table[keep:])
            request.block_table = request.block_table[:keep]
        return RequestOutput(request.request_id, [t for o in outputs for t in o.new_token_ids],
                             "".join(o.new_text for o in outputs), outputs[-1].finished, outputs[-1].finish_reason)

    # ----- reports ---------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        return super().stats() | {"speculative_proposed_total": self.proposed_tokens,
                                  "speculative_accepted_total": self.accepted_tokens,
                                  "speculative_verify_rows_total": self.verify_rows}

    def memory_report(self) -> str:
        if not self.verify_rows:
            return super().memory_report()
        rate = self.accepted_tokens / max(1, self.proposed_tokens)
        return (f"{super().memory_report()}\nspeculation: {self.accepted_tokens} of {self.proposed_tokens} proposals "
                f"kept ({rate:.0%}), {(self.verify_rows + self.accepted_tokens) / self.verify_rows:.2f} tokens "
                f"per verification row")
