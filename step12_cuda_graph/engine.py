"""Step 12: decode steps and mixed steps replayed as CUDA graphs; everything else is step 10's.

Against step 10, `CudaGraphEngine` changes how a step runs, not what it computes:
- a decode-only step (`decode_graphs.py`): the batch is padded to a bucket, its inputs are written into
  static buffers, and the bucket's captured graph is replayed;
- a mixed step, decoders and prefill chunks in one forward (`mixed_graphs.py`): its tokens are padded to a
  token bucket, its requests to a row bucket, and that bucket's graph is replayed.
The token budget, prefix caching, scheduling, preemption and priorities are steps 09 and 10's, so requests
join, leave and get preempted between replays exactly as before. One block of the pool is reserved as the
dummy block that padded rows and tokens write to.

Once the GPU no longer waits for kernel launches, it waits for the host between steps: reading the tokens,
detokenizing, checking for stops, scheduling. With `overlap` (on where decode is captured) each decode step
is launched before the host processes the previous one's tokens (`launch_ahead`), so that work is done
while the GPU computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.loading import LoadedModel
from common.request import Request, RequestOutput
from step02_paged_kv.kv_cache import PagedKVCache
from step09_chunked_prefill.engine import Chunk
from step10_prefix_caching.engine import PrefixCachingEngine, PrefixCachingEngineConfig
from step12_cuda_graph.decode_graphs import GRAPH_BYTES_PER_LOGIT, DecodeGraphs, PendingTokens
from step12_cuda_graph.mixed_graphs import MixedChunk, MixedStepGraphs


@dataclass
class LaunchedDecode:
    """A decode step on the GPU: each request's row, the length it was computed at, and its tokens to come."""

    rows: dict[str, int]
    seq_lens: dict[str, int]
    tokens: PendingTokens

    def covers(self, requests: list[Request]) -> bool:
        """Whether this step computed the next token of every one of these requests (and more is fine: the
        rows of requests that finished meanwhile are ignored)."""
        return all(self.seq_lens.get(r.request_id) == r.num_tokens for r in requests)


@dataclass
class CudaGraphEngineConfig(PrefixCachingEngineConfig):
    cuda_graph: bool = True  # False: step 10's eager decode and mixed steps, for comparison
    max_graph_batch: int = 256  # larger decode batches run eagerly
    # Launch each decode step before the host turns the previous step's tokens into text (`launch_ahead`).
    # None: on wherever decode is captured (eagerly, on a CPU, there is nothing to overlap).
    overlap: bool | None = None
    # Mixed steps (decoders and prefill chunks) on static buffers, replayed as graphs per token bucket
    # (`mixed_graphs.py`). None: on wherever decode is captured (eagerly, padding would only cost time).
    mixed_graphs: bool | None = None


class CudaGraphEngine(PrefixCachingEngine):
    config_class = CudaGraphEngineConfig
    reserved_blocks = 1  # the dummy block: padded rows write their K/V there, and nobody reads it

    def __init__(self, loaded: LoadedModel, config: CudaGraphEngineConfig) -> None:
        super().__init__(loaded, config)
        self.dummy_block = self.allocator.num_blocks  # the one block past those the allocator hands out
        self.graphs: DecodeGraphs | None = None
        self.eager_reason = self.why_not_capture(config)
        self.overlap = self.eager_reason is None if config.overlap is None else config.overlap
        self.ahead: LaunchedDecode | None = None  # launched during this step, for the next one
        self.launched_ahead: LaunchedDecode | None = None  # launched during the last step, for this one
        self.steps_launched_ahead = 0
        self.steps_taken_from_ahead = 0  # the others were launched again (their batch had changed)
        if config.cuda_graph:
            self.graphs = self.build_graphs(config)
        self.mixed: MixedStepGraphs | None = None
        mixed_graphs = self.eager_reason is None if config.mixed_graphs is None else config.mixed_graphs
        if mixed_graphs:
            self.mixed = MixedStepGraphs(self.model, self.cache, self.backend, self.max_model_len, self.dummy_block,
                                         self.worst_step_tokens(config), config.max_num_seqs,
                                         capture=self.eager_reason is None)
        print(f"[{type(self).__name__}] decode: {self.graph_status()}", flush=True)  # said at start-up

    def build_graphs(self, config: CudaGraphEngineConfig) -> DecodeGraphs:
        """The decode forward on static buffers, captured where it can be (a method: what is captured is the
        one thing a later step changes)."""
        return DecodeGraphs(self.model, self.cache, self.backend, self.max_model_len, self.dummy_block,
                            self.max_graph_batch(config), capture=self.eager_reason is None)

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
        per_block = PagedKVCache.bytes_per_block(self.model.config, config.block_size, self.model.dtype)
        return max(1, blocks - graph_bytes // per_block)

    def why_not_capture(self, config: CudaGraphEngineConfig) -> str | None:
        """None if decode can be captured; otherwise the reason it runs eagerly, to be said out loud."""
        if not config.cuda_graph:
            return "--no-cuda-graph: step 10's eager steps"
        if self.device.type != "cuda":
            return "CUDA graphs need a CUDA device: the padded static-buffer decode runs eagerly"
        if self.backend.name == "torch":
            return ("the torch backend sizes its gather from a host number (the longest length), which a graph "
                    "would freeze: use --attn triton or flash_attn; decoding eagerly")
        if config.sync_per_layer:
            return "--sync-per-layer reads a device value on the host, which a graph cannot hold; decoding eagerly"
        return None

    def graph_status(self) -> str:
        described = self.graphs.describe() if self.graphs else "no graphs"
        if self.mixed is not None:
            described += f"; {self.mixed.describe()}"
        if self.eager_reason is not None:
            described += f": {self.eager_reason}"
        if self.overlap:
            described += "; each step launched before the host processes the previous one"
        return described

    def step(self) -> list[RequestOutput]:
        self.launched_ahead, self.ahead = self.ahead, None  # good for this step only; `decode` takes it if it fits
        return super().step()

    @torch.inference_mode()
    def compute_chunks(self, chunks: list[Chunk], sampling: list[Chunk]) -> list[int]:
        """Step 09's mixed forward, replayed where captured. When new work arrives, the decode step launched
        ahead during the last step has already computed the decoders' next tokens (and written their K/V):
        those decoders are taken from it, and only the other chunks run, rather than computing them twice."""
        ahead, self.launched_ahead = self.launched_ahead, None
        if ahead is None:
            return self.run_chunks(chunks, sampling)
        taken = {c.request.request_id for c in chunks
                 if c.num_tokens == 1 and ahead.seq_lens.get(c.request.request_id) == c.end == c.request.num_tokens}
        if not taken:
            return self.run_chunks(chunks, sampling)
        self.steps_taken_from_ahead += 1
        rest = [c for c in chunks if c.request.request_id not in taken]
        rest_tokens = iter(self.run_chunks(rest, [c for c in rest if c.samples]))
        ahead_tokens = ahead.tokens.wait()
        return [ahead_tokens[ahead.rows[c.request.request_id]] if c.request.request_id in taken else next(rest_tokens)
                for c in sampling]

    def run_chunks(self, chunks: list[Chunk], sampling: list[Chunk]) -> list[int]:
        """The mixed forward on the static buffers of `MixedStepGraphs`, replayed where captured (else step 09's)."""
        if self.mixed is None or not self.mixed.fits(sum(c.num_tokens for c in chunks), len(chunks)):
            return super().compute_chunks(chunks, sampling)
        pending = self.mixed.launch([
            MixedChunk(self.chunk_token_ids(c), c.start, self.block_tables[c.request.request_id], c.samples,
                       c.request.params, len(c.request.output_token_ids)) for c in chunks])
        if not sampling:
            return []  # nothing to wait for
        tokens = pending.wait()
        return [token for token, chunk in zip(tokens, chunks) if chunk.samples]

    @torch.inference_mode()
    def decode(self, requests: list[Request]) -> list[RequestOutput]:
        ahead, self.launched_ahead = self.launched_ahead, None
        if self.graphs is None or len(requests) > self.graphs.max_batch:
            return super().decode(requests)
        # The step launched ahead computed these requests' tokens already, unless the batch changed since
        # in a way it could not foresee (someone swapped in, or was preempted and admitted again).
        if ahead is not None and ahead.covers(requests):
            current = ahead
            self.steps_taken_from_ahead += 1
        else:
            current = self.launch(requests)
        if self.overlap:
            self.ahead = self.launch_ahead(current)
            self.steps_launched_ahead += self.ahead is not None
        sampled = current.tokens.wait()  # the GPU goes on with the step launched ahead meanwhile
        return self.process_tokens(requests, [sampled[current.rows[r.request_id]] for r in requests])

    def launch(self, requests: list[Request], previous: LaunchedDecode | None = None) -> LaunchedDecode:
        """Give each request its next block if it needs one and launch its decode step. A request of
        `previous` has a token there that the host has not appended yet: that token is its input, read on
        the device, and its length counts it."""
        assert self.graphs is not None
        token_ids, previous_rows, seq_lens, output_positions = [], [], [], []
        for request in requests:
            row = previous.rows.get(request.request_id, -1) if previous is not None else -1
            pending = int(row >= 0)  # its input token is still on the device
            token_ids.append(0 if pending else request.output_token_ids[-1])
            previous_rows.append(row)
            seq_lens.append(request.num_tokens + pending)
            output_positions.append(len(request.output_token_ids) + pending)
            self.grow_block_table(request, seq_lens[-1])
        tokens = self.graphs.launch(token_ids, previous_rows, seq_lens,
                                    [self.block_tables[r.request_id] for r in requests],
                                    [r.params for r in requests], output_positions)
        return LaunchedDecode({r.request_id: i for i, r in enumerate(requests)},
                              {r.request_id: n for r, n in zip(requests, seq_lens)}, tokens)

    def launch_ahead(self, current: LaunchedDecode) -> LaunchedDecode | None:
        """Launch the next decode step now, before the host has seen this one's tokens, so that the GPU
        computes it while the host detokenizes, checks for stops and schedules. Its batch is a guess: every
        running request (those prefilled this step included) except the ones this step's token finishes by
        length. A request that stops otherwise (end of sequence, a stop string, an abort) costs only a
        wasted row; a batch the guess cannot cover (a swapped request coming back, or no free block for the
        guess) makes the next step launch afresh. Nothing is launched ahead while prefill work waits: the next
        step is then likely a mixed one, which the scheduler lays out."""
        assert self.graphs is not None
        if self.swapped or self.prefill_pending():
            return None  # the next step may bring a request back, or be a mixed step
        batch = [r for r in self.running if not self.finishes_by_length(r, pending=r.request_id in current.rows)]
        if not batch or len(batch) > self.graphs.max_batch:
            return None
        new_blocks = sum(self.needs_new_block(r, r.num_tokens + (r.request_id in current.rows)) for r in batch)
        if new_blocks > self.allocator.num_free:
            return None  # the scheduler decides who gets the last blocks (and who is preempted)
        return self.launch(batch, previous=current)

    @staticmethod
    def finishes_by_length(request: Request, pending: bool) -> bool:
        """Whether the request is done by length once its token still on the device (if any) is appended."""
        outputs = len(request.output_token_ids) + pending
        return outputs >= request.params.max_tokens or request.num_tokens + pending >= request.max_model_len

    def memory_report(self) -> str:
        overlap = (f"\noverlap: {self.steps_launched_ahead} decode steps launched ahead, "
                   f"{self.steps_taken_from_ahead} of them used" if self.overlap else "")
        return f"{super().memory_report()}\ndecode: {self.graph_status()}{overlap}"
