"""Decode steps replayed as CUDA graphs: the host launches one graph instead of a thousand kernels.

A decode step of a 7B model is about a thousand small kernels (per layer: two norms, four projections,
RoPE, the KV write, attention and its merge, the MLP). Launched one at a time from Python, each costs the
host several microseconds, and on a slow host the GPU waits: the step lasts as long as the launching. A
CUDA graph records the kernels of one forward once (`torch.cuda.graph`) and replays all of them with one
call. What it records is frozen: the same kernels, on the same addresses, with the same shapes and the
same scalar arguments. Hence everything in this module:

- one graph per batch-size *bucket* (1, 2, 4, 8, then every 16), a batch padded up to the next bucket;
- inputs at fixed addresses (`StaticDecodeInputs`), overwritten before each replay; padded rows point
  at a reserved dummy block, so their K/V writes land where no request reads;
- whatever changes between steps is read by the kernels from device memory: lengths, block tables,
  slots. A host number captured into a launch stays what it was at capture time, so the number of
  sequence splits of the decode kernel is fixed per graph (each row then divides its own length, read
  from `seq_lens`, among those splits). Splits sized for the longest context the engine allows leave
  short ones in slivers: so each bucket gets a second graph for batches whose sequences are all short
  (`SHORT_CONTEXT`), where the backend would split them differently, and a replay takes the graph that
  fits its longest sequence.

Without a CUDA device (or with an attention backend that sizes its work from host numbers) the same
padded, static-buffer forward simply runs eagerly: the path is the same, only not recorded.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from common.model import CausalLM
from common.sampling import SamplingParams, SamplingTensors, sample_rows
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import AttentionBackend, AttentionMetadata
from step06_paged_attention.engine import PagedAttentionForward

# What a graph leaves behind: each row's greedy token; a token drawn by the sampler's tensors (`sample_rows`); or
# the logits themselves, for the sampler to pick from outside the graph where a row needs more than the logits
# (penalties and a bias count its tokens so far; log-probabilities go back to the host with the token).
GREEDY, SAMPLED, LOGITS = "greedy", "sampled", "logits"

# Padded rows in a sampling batch: greedy, so they never touch the noise; a fixed seed keeps them cheap.
PAD_PARAMS = SamplingParams(seed=0)

# Tokens up to which a batch counts as short: step 06's decode kernel then makes at most 4 splits (of at
# least one 64-token tile each), and merges them inside the kernel, without its merge kernel.
SHORT_CONTEXT = 256


# Graph memory per (padded row x vocabulary entry): the sampling graph keeps several [rows, vocab] temporaries
# (float32 logits, scaled logits, noise, sort values; int64 hashes and sort indices). Measured on the H200 at
# start-up: 60 to 140 bytes for the bundled models (before the static logits of the LOGITS graphs, 4 bytes each
# for the decode graphs and as many for the mixed ones); this estimate is what the default KV budget sets aside.
GRAPH_BYTES_PER_LOGIT = 168


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 16, and `max_batch` itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def greedy_tokens(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token, for a batch where every row is greedy: no sampler's work. The logits stay in
    the model's dtype (widening them to float32 is exact, so the token would be the same)."""
    return model.lm_head(model.model.norm(hidden)).argmax(dim=-1)


class GraphRecorder:
    """Captures CUDA graphs into one memory pool (the graphs of one recorder never run at once), and measures
    the time and the memory they took."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.started = time.perf_counter()
        torch.cuda.synchronize(device)
        # Cached blocks nobody holds are handed back first: the allocator could otherwise release them in the
        # middle of the capture (when it runs short), and the difference `finish` takes would mean nothing.
        torch.cuda.empty_cache()
        self.reserved_before = torch.cuda.memory_reserved(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(device)

    def record(self, forward: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """`forward` run once eagerly, on a side stream (Triton compiles, cuBLAS picks its kernels, and the
        allocator settles, none of which may happen during a capture), then captured."""
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            forward()
        current.wait_stream(self.side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        return graph

    def finish(self) -> tuple[float, int]:
        """Seconds since the recorder was made, and the bytes of memory its graphs reserved."""
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.started, torch.cuda.memory_reserved(self.device) - self.reserved_before


@dataclass
class DecodeBatch:
    """One decode step's rows, as the host knows them: per request its newest token, its length with that
    token, its block table, and how to sample (its parameters, and the position in its output of the token
    drawn)."""

    token_ids: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    params: list[SamplingParams]
    output_positions: list[int]

    def __len__(self) -> int:
        return len(self.token_ids)


class StaticDecodeInputs:
    """A decode batch's integer inputs at fixed device addresses, refilled from pinned host memory by one copy.

    One flat int32 buffer: the per-row fields (`FIELDS`), each `max_batch` long, then the block table,
    `max_batch` rows of `width` blocks. A bucket's rows are then a prefix of each, so one copy of that prefix
    refreshes everything a replay reads."""

    FIELDS: tuple[str, ...] = ("input_ids", "positions", "seq_lens", "slot_mapping")

    def __init__(self, max_batch: int, width: int, block_size: int, dummy_block: int, device: torch.device):
        self.max_batch, self.width, self.block_size, self.dummy_block = max_batch, width, block_size, dummy_block
        size = len(self.FIELDS) * max_batch + max_batch * width
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=device)
        # Pinned memory lets the copy run asynchronously. The host must then not rewrite it before the copy
        # has run: `copied` marks that moment, and the next fill waits for it.
        self.host_buffer = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.copied: torch.cuda.Event | None = None
        for name, view in self.views(self.device_buffer).items():
            setattr(self, name, view)  # self.input_ids, self.positions, ..., self.block_table
        self.host = self.views(self.host_buffer)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        b = self.max_batch
        per_row = {name: buffer[i * b : (i + 1) * b] for i, name in enumerate(self.FIELDS)}
        return per_row | {"block_table": buffer[len(self.FIELDS) * b :].view(b, self.width)}

    def token_inputs(self, bucket: int, last_tokens: torch.Tensor) -> torch.Tensor:
        """The input token of each of `bucket` rows. `last_tokens`, what the last replay sampled, is unused here: a
        method, so that step 14 can read some rows' inputs from it on the device."""
        return self.input_ids[:bucket]

    def wait_for_last_copy(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()  # the last copy out of the host buffer has run

    def fill(self, batch: DecodeBatch, bucket: int) -> None:
        """Rows 0..n-1 get the requests; rows n..bucket-1 are padding: one token at position 0 of the dummy block."""
        self.wait_for_last_copy()
        self.write_rows(batch, bucket)
        prefix = len(self.FIELDS) * self.max_batch + bucket * self.width
        self.device_buffer[:prefix].copy_(self.host_buffer[:prefix], non_blocking=True)
        if self.device_buffer.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    # The rows' values apart from their transfer (`fill`): what a padded bucket holds, written in one place.
    def write_rows(self, batch: DecodeBatch, bucket: int) -> None:
        """Write the host buffer's first `bucket` rows of every field: the requests, then padded rows (token 0,
        position 0, length 1, slot and table on the dummy block, which no request reads)."""
        host, tables = self.host, batch.tables
        pad = bucket - len(batch)
        size, dummy = self.block_size, self.dummy_block
        pos = [n - 1 for n in batch.seq_lens]  # the new token's position: it is the last of its sequence
        host["input_ids"][:bucket] = torch.tensor([*batch.token_ids, *[0] * pad], dtype=torch.int32)
        host["positions"][:bucket] = torch.tensor([*pos, *[0] * pad], dtype=torch.int32)
        host["seq_lens"][:bucket] = torch.tensor([*batch.seq_lens, *[1] * pad], dtype=torch.int32)
        host["slot_mapping"][:bucket] = torch.tensor([*(t[p // size] * size + p % size for t, p in zip(tables, pos)),
                                                      *[dummy * size] * pad], dtype=torch.int32)
        # Only the columns some row uses are written: a kernel never reads past its row's length.
        used = max((len(t) for t in tables), default=1)
        rows = [t + [dummy] * (used - len(t)) for t in tables] + [[dummy] * used] * pad
        host["block_table"][:bucket, :used] = torch.tensor(rows, dtype=torch.int32)


class PendingTokens:
    """A launched step's sampled tokens, copied to pinned host memory as soon as the step has run."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=tokens.is_cuda)
        self.host.copy_(tokens, non_blocking=True)
        self.done: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def wait(self) -> list[int]:
        """Block until this step (and nothing queued after it) has run; its tokens."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class DecodeGraphs:
    """The decode forward (embedding, layers, logits, sampling) on static buffers, captured once per
    bucket and per sampling mode (greedy-only batches skip the sampler's work: `greedy_tokens`), then
    replayed."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: AttentionBackend, max_model_len: int,
                 dummy_block: int, max_batch: int, capture: bool,
                 inputs_class: type[StaticDecodeInputs] = StaticDecodeInputs) -> None:
        self.model, self.cache, self.backend, self.max_model_len = model, cache, backend, max_model_len
        self.device = model.device
        self.buckets = graph_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.inputs = inputs_class(self.max_batch, cache.blocks_for(max_model_len), cache.block_size, dummy_block,
                                   self.device)
        self.cu_q_lens = torch.arange(self.max_batch + 1, dtype=torch.int32, device=self.device)
        vocab = self.model.config.vocab_size
        self.sampling = SamplingTensors.build([PAD_PARAMS] * self.max_batch, [0] * self.max_batch, vocab, self.device)
        self.tokens = torch.zeros(self.max_batch, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(self.max_batch, vocab, device=self.device)
        # The longest sequence each bucket's graphs are captured for, shortest first.
        self.frozen_lens = {bucket: self.lengths_to_capture(bucket) for bucket in self.buckets}
        self.graphs: dict[tuple[int, str, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        if capture:
            self.capture_all()

    def bucket_for(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    @torch.inference_mode()
    def forward(self, bucket: int, output: str, max_seq_len: int) -> None:
        """What one graph holds: read the static inputs of `bucket` rows, write their next tokens to `tokens` (or,
        for `output` LOGITS, their logits to `logits`)."""
        s = self.inputs
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=s.slot_mapping[:bucket], block_table=s.block_table[:bucket],
            seq_lens=s.seq_lens[:bucket], cu_q_lens=self.cu_q_lens[: bucket + 1], q_lens=[1] * bucket,
            # No host lengths: a replay could not see them. Decode backends read `seq_lens` on the device.
            seq_lens_host=[], max_q_len=1, max_seq_len=max_seq_len, block_size=s.block_size,
        )
        positions = s.positions[:bucket]
        hidden = self.model(s.token_inputs(bucket, self.tokens), self.context(meta, positions))
        if output == SAMPLED:
            logits = self.model.compute_logits(hidden)
            rows = SamplingTensors(**{f.name: getattr(self.sampling, f.name)[:bucket] for f in fields(SamplingTensors)})
            self.tokens[:bucket] = sample_rows(logits, rows)
        elif output == LOGITS:
            self.logits[:bucket] = self.model.compute_logits(hidden)
        else:
            self.tokens[:bucket] = self.greedy_tokens(hidden)

    def context(self, meta: AttentionMetadata, positions: torch.Tensor) -> PagedAttentionForward:
        """Step 06's paged-attention context, over the static buffers."""
        return PagedAttentionForward(self.cache, self.backend, meta, positions)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token (a seam: step 13 finds it inside its output head's multiply)."""
        return greedy_tokens(self.model, hidden)

    def capture_all(self) -> None:
        """Record every bucket's graphs, largest first, all in one memory pool (they never run at once)."""
        recorder = GraphRecorder(self.device)
        for bucket in reversed(self.buckets):
            # Every row on the dummy block: the capture writes nothing a request reads.
            self.inputs.fill(DecodeBatch([], [], [], [], []), bucket)
            for output, frozen_len in itertools.product((GREEDY, SAMPLED, LOGITS), self.frozen_lens[bucket]):
                self.graphs[bucket, output, frozen_len] = recorder.record(
                    lambda: self.forward(bucket, output, frozen_len))  # noqa: B023 - called at once
        self.capture_seconds, self.capture_bytes = recorder.finish()

    def launch(self, batch: DecodeBatch) -> PendingTokens:
        """Fill the static inputs and replay the bucket's graph (or run the same forward eagerly), without
        waiting for it."""
        n = len(batch)
        bucket = self.bucket_for(n)
        self.inputs.fill(batch, bucket)
        output = GREEDY if all(p.greedy for p in batch.params) else SAMPLED
        if output == SAMPLED:
            padded_params = [*batch.params, *[PAD_PARAMS] * (bucket - n)]
            positions = [*batch.output_positions, *[0] * (bucket - n)]
            # Built on the host and copied into the static buffers: one small transfer per field, from pinned
            # memory (a copy from ordinary memory would make the host wait for the GPU to be idle).
            rows = SamplingTensors.build(padded_params, positions, self.model.config.vocab_size, torch.device("cpu"))
            pinned = self.device.type == "cuda"
            for f in fields(SamplingTensors):
                field = getattr(rows, f.name)
                getattr(self.sampling, f.name)[:bucket].copy_(field.pin_memory() if pinned else field, non_blocking=pinned)
        self.replay(bucket, output, max(batch.seq_lens))
        return PendingTokens(self.tokens[:n])

    def logits_for(self, batch: DecodeBatch) -> torch.Tensor:
        """Replay the bucket's LOGITS graph for the batch: its logits [len(batch), vocab], for the sampler."""
        bucket = self.bucket_for(len(batch))
        self.inputs.fill(batch, bucket)
        self.replay(bucket, LOGITS, max(batch.seq_lens))
        return self.logits[: len(batch)]

    def replay(self, bucket: int, output: str, longest: int) -> None:
        """Replay the graph for this bucket, output and longest sequence (or run the same forward eagerly)."""
        graph = self.graph_for(bucket, output, longest)
        if graph is not None:
            graph.replay()
        else:
            self.forward(bucket, output, longest)

    def lengths_to_capture(self, bucket: int) -> list[int]:
        """The longest context allowed, and before it SHORT_CONTEXT where the backend would split a batch of
        that length differently (a graph fixes the split count, so it needs a graph of its own)."""
        kv_heads = self.model.config.num_kv_heads
        splits = self.backend.num_splits
        if SHORT_CONTEXT < self.max_model_len and (splits(bucket, kv_heads, SHORT_CONTEXT)
                                                   != splits(bucket, kv_heads, self.max_model_len)):
            return [SHORT_CONTEXT, self.max_model_len]
        return [self.max_model_len]

    def frozen_len_for(self, bucket: int, longest: int) -> int:
        """The shortest length the bucket's graphs are captured for that holds a sequence of `longest`."""
        return next((n for n in self.frozen_lens[bucket] if n >= longest), self.max_model_len)

    def graph_for(self, bucket: int, output: str, longest: int) -> torch.cuda.CUDAGraph | None:
        """The bucket's graph for a batch whose longest sequence is `longest` (None: none captured)."""
        return self.graphs.get((bucket, output, self.frozen_len_for(bucket, longest)))

    def describe(self) -> str:
        if not self.graphs:
            return f"decode on static buffers, eager (buckets {self.buckets})"
        short = [bucket for bucket, lens in self.frozen_lens.items() if len(lens) > 1]
        short_too = f", buckets {short} also for contexts up to {SHORT_CONTEXT} tokens" if short else ""
        return (f"{len(self.graphs)} CUDA graphs (buckets {self.buckets}{short_too}, greedy, sampling and logits) "
                f"captured in {self.capture_seconds:.1f} s, {self.capture_bytes / 2**20:.0f} MiB of graph memory")
