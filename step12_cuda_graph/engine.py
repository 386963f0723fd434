"""Step 12: decode steps and mixed steps replayed as CUDA graphs; everything else is step 11's.

Against step 11, `CudaGraphEngine` changes how a step runs, not what it computes:
- a decode-only step (`decode_graphs.py`): the batch is padded to a bucket, its inputs are written into
  static buffers, and the bucket's captured graph is replayed;
- a mixed step, decoders and prefill chunks in one forward (`mixed_graphs.py`): its tokens are padded to a
  token bucket, its requests to a row bucket, and that bucket's graph is replayed;
- a speculative step (`verify_graphs.py`): the same, with smaller token buckets and an output at every verified
  token: its greedy token, or its logits where a row samples.
The token budget, prefix caching, speculation, scheduling, preemption and priorities are steps 09 to 11's, so requests
join, leave and get preempted between replays exactly as before. The pool has one block more than the
allocator hands out: the dummy block, which padded rows and tokens write to and nobody reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.loading import LoadedModel
from common.request import RequestOutput
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import AttentionBackend
from step09_chunked_prefill.engine import Chunk
from step11_speculative_decoding import verify as verification
from step11_speculative_decoding.engine import (SpeculativeChunk, SpeculativeEngine, SpeculativeEngineConfig,
                                                SpeculativeRequest)
from step12_cuda_graph.decode_graphs import (GRAPH_BYTES_PER_LOGIT, GREEDY, LOGITS, DecodeBatch, DecodeGraphs,
                                             PendingTokens, StaticDecodeInputs)
from step12_cuda_graph.mixed_graphs import MixedChunk, MixedStepGraphs, TileListTritonBackend
from step12_cuda_graph.verify_graphs import VERIFY_BYTES_PER_LOGIT, VERIFY_MAX_TOKENS, VerifyStepGraphs


@dataclass
class CudaGraphEngineConfig(SpeculativeEngineConfig):
    cuda_graph: bool = True  # False: step 11's eager decode and mixed steps, for comparison
    max_graph_batch: int = 256  # larger decode batches run eagerly
    # Mixed steps (decoders and prefill chunks) on static buffers, replayed as graphs per token bucket
    # (`mixed_graphs.py`). None: on wherever decode is captured (eagerly, padding would only cost time).
    mixed_graphs: bool | None = None


class CudaGraphEngine(SpeculativeEngine):
    config_class = CudaGraphEngineConfig
    captures_cuda_graphs = True
    decode_inputs_class = StaticDecodeInputs  # the static buffers a decode graph reads

    def __init__(self, loaded: LoadedModel, config: CudaGraphEngineConfig) -> None:
        super().__init__(loaded, config)
        self.dummy_block = self.allocator.num_blocks  # the one block of the pool past those the allocator hands out
        self.eager_reason = self.why_not_capture(config)
        self.graphs: DecodeGraphs | None = self.build_graphs(config) if config.cuda_graph else None
        self.mixed: MixedStepGraphs | None = None
        mixed_graphs = self.eager_reason is None if config.mixed_graphs is None else config.mixed_graphs
        if mixed_graphs:
            self.mixed = self.build_mixed_graphs(config)
        self.verify_graphs: VerifyStepGraphs | None = None
        if self.mixed is not None and self.proposer is not None:
            self.verify_graphs = self.build_verify_graphs(config)
        print(f"[{type(self).__name__}] decode: {self.graph_status()}", flush=True)  # said at start-up

    def backend_classes(self, config: CudaGraphEngineConfig) -> dict[str, type[AttentionBackend]]:
        return {**super().backend_classes(config), "triton": TileListTritonBackend}  # its prefill can be captured

    def create_cache(self, num_blocks: int) -> PagedKVCache:
        return super().create_cache(num_blocks + 1)  # the dummy block

    def build_graphs(self, config: CudaGraphEngineConfig) -> DecodeGraphs:
        """The decode forward on static buffers, captured where it can be (a method: what is captured is the
        one thing a later step changes)."""
        return DecodeGraphs(self.model, self.cache, self.backend, self.max_model_len, self.dummy_block,
                            self.max_graph_batch(config), capture=self.eager_reason is None,
                            inputs_class=self.decode_inputs_class)

    def build_mixed_graphs(self, config: CudaGraphEngineConfig) -> MixedStepGraphs:
        """Step 09's mixed steps on static buffers (a method, as `build_graphs`: step 13 fuses them)."""
        return MixedStepGraphs(self.model, self.cache, self.backend, self.max_model_len, self.dummy_block,
                               self.worst_step_tokens(config), config.max_num_seqs, capture=self.eager_reason is None)

    def build_verify_graphs(self, config: CudaGraphEngineConfig) -> VerifyStepGraphs:
        """Step 11's verification steps on static buffers (a method, as `build_graphs`: step 13 fuses them)."""
        return VerifyStepGraphs(self.model, self.cache, self.backend, self.max_model_len, self.dummy_block,
                                self.verify_max_tokens(config), config.max_num_seqs,
                                capture=self.eager_reason is None)

    def verify_max_tokens(self, config: CudaGraphEngineConfig) -> int:
        return min(VERIFY_MAX_TOKENS, self.worst_step_tokens(config))

    @staticmethod
    def max_graph_batch(config: CudaGraphEngineConfig) -> int:
        return max(1, min(config.max_graph_batch, config.max_num_seqs))

    def blocks_in_budget(self, config: CudaGraphEngineConfig) -> int:
        """Step 02's budget, less what the graphs will hold (an estimate: they are captured after the pool
        exists, since they record its address; the real figure is printed at start-up)."""
        blocks = super().blocks_in_budget(config)
        if not config.cuda_graph or self.device.type != "cuda":
            return blocks
        graph_bytes = GRAPH_BYTES_PER_LOGIT * self.max_graph_batch(config) * self.model.config.vocab_size
        if config.speculative_tokens:
            graph_bytes += VERIFY_BYTES_PER_LOGIT * self.verify_max_tokens(config) * self.model.config.vocab_size
        per_block = PagedKVCache.bytes_per_block(self.model.config, config.block_size, self.model.dtype)
        return max(1, blocks - graph_bytes // per_block)

    def why_not_capture(self, config: CudaGraphEngineConfig) -> str | None:
        """None if decode can be captured; otherwise the reason it runs eagerly, to be said out loud."""
        if not config.cuda_graph:
            return "--no-cuda-graph: step 11's eager steps"
        if self.device.type != "cuda":
            return "CUDA graphs need a CUDA device: the padded static-buffer decode runs eagerly"
        if not self.backend.capturable_decode:
            return (f"the {self.backend.name} backend sizes its decode from host numbers (the longest length), which "
                    "a graph would freeze: use --attn triton or flash_attn; decoding eagerly")
        if config.sync_per_layer:
            return "--sync-per-layer reads a device value on the host, which a graph cannot hold; decoding eagerly"
        return None

    def graph_status(self) -> str:
        described = self.graphs.describe() if self.graphs else "no graphs"
        if self.mixed is not None:
            described += f"; {self.mixed.describe()}"
        if self.verify_graphs is not None:
            described += f"; {self.verify_graphs.describe()}"
        if self.eager_reason is not None:
            described += f": {self.eager_reason}"
        return described

    # ----- running a step on the static buffers ------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, requests: list[SpeculativeRequest]) -> list[RequestOutput]:
        if self.graphs is None or len(requests) > self.graphs.max_batch:
            return super().decode(requests)
        if self.needs_logits(requests):
            # The graph computes the logits; the sampler picks from them, outside the graph.
            return self.process_tokens(requests, self.sample(self.graphs.logits_for(self.decode_batch(requests)),
                                                             requests))
        return self.process_tokens(requests, self.launch(requests).wait())

    @staticmethod
    def needs_logits(requests: list[SpeculativeRequest]) -> bool:
        """Whether a request uses a penalty or a bias, or asks for log-probabilities: the sampler inside a graph
        sees the logits alone, so such a batch replays the graph that leaves the logits, for `Engine.sample`."""
        return any(r.params.needs_logits for r in requests)

    def launch(self, requests: list[SpeculativeRequest]) -> PendingTokens:
        """Give each request its next block if it needs one, and launch its decode step without waiting."""
        assert self.graphs is not None
        return self.graphs.launch(self.decode_batch(requests))

    def decode_batch(self, requests: list[SpeculativeRequest]) -> DecodeBatch:
        """The decode step's rows, each request given its next block if it needs one."""
        for request in requests:
            self.grow_block_table(request, request.num_tokens)
        return DecodeBatch([r.output_token_ids[-1] for r in requests], [r.num_tokens for r in requests],
                           [r.block_table for r in requests], [r.params for r in requests],
                           [len(r.output_token_ids) for r in requests])

    @torch.inference_mode()
    def compute_chunks(self, chunks: list[Chunk], sampling: list[Chunk]) -> list[int]:
        """Step 09's mixed forward on the static buffers of `MixedStepGraphs`, replayed where captured."""
        if self.mixed is None or not self.mixed.fits(sum(c.num_tokens for c in chunks), len(chunks)):
            return super().compute_chunks(chunks, sampling)
        if self.needs_logits([c.request for c in sampling]):
            logits = self.mixed.logits_for([self.mixed_chunk(c) for c in chunks])
            rows = [i for i, c in enumerate(chunks) if c.samples]
            return self.sample(logits[rows], [c.request for c in sampling])
        pending = self.mixed.launch([self.mixed_chunk(c) for c in chunks])
        if not sampling:
            return []  # nothing to wait for
        tokens = pending.wait()
        return [token for token, chunk in zip(tokens, chunks) if chunk.samples]

    def mixed_chunk(self, chunk: Chunk) -> MixedChunk:
        return MixedChunk(self.chunk_token_ids(chunk), chunk.start, chunk.request.block_table, chunk.samples,
                          chunk.request.params, len(chunk.request.output_token_ids))

    # ----- speculative steps: within the verification graphs' buckets ---------------------------------------

    def speculation_token_limit(self) -> int:
        """Proposals stop where the verification graphs do: a larger step would run eagerly."""
        if self.verify_graphs is None:
            return super().speculation_token_limit()
        return min(super().speculation_token_limit(), self.verify_graphs.token_buckets[-1])

    @torch.inference_mode()
    def compute_verified(self, chunks: list[SpeculativeChunk]) -> list[list[int]]:
        graphs = self.verify_graphs
        if graphs is None or not graphs.fits(sum(c.num_tokens for c in chunks), len(chunks)):
            return super().compute_verified(chunks)
        # A penalty or bias (its greedy token is not their argmax) or log-probabilities need the logits: the sampler
        # picks its token.
        sampled = any(not c.request.params.greedy or c.request.params.needs_logits for c in chunks if c.samples)
        outputs = graphs.run([self.mixed_chunk(c) for c in chunks], LOGITS if sampled else GREEDY)
        outputs = outputs[self.logit_rows(chunks)]
        return self.tokens_from_logits(chunks, outputs) if sampled else self.tokens_from_argmax(chunks, outputs)

    def tokens_from_argmax(self, chunks: list[SpeculativeChunk], argmax: torch.Tensor) -> list[list[int]]:
        """Step 11's `tokens_from_logits` for a step whose every sampling chunk is greedy, from each logit row's
        argmax alone (the verification graphs find it without writing the logits)."""
        best, emitted, row = argmax.tolist(), [], 0
        for chunk in chunks:
            rows = best[row : row + len(chunk.logit_rows)]
            if chunk.proposals:
                tokens = verification.accept_greedy(chunk.proposals, rows)
                self.record_outcome(chunk.request, len(chunk.proposals), len(tokens) - 1)
                emitted.append(tokens)
            elif chunk.samples:
                emitted.append(rows)
            row += len(rows)
        return emitted

    def memory_report(self) -> str:
        return f"{super().memory_report()}\ndecode: {self.graph_status()}"
