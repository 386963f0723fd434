"""Mixed steps (decoders and prefill chunks in one forward) replayed as CUDA graphs, one per token bucket.

Step 09's mixed step runs eagerly: on the H200's host a 7B model's eager step costs 34 to 45 ms whatever its
size, 8 to 10 replayed decode steps, and that fixed cost bounds how short the decoders' wait can get. A graph
freezes shapes, addresses and launch grids, so a mixed step is laid out for the worst case of its bucket:

- its tokens padded to a bucket (`mixed_token_buckets`: 32, 64, ... up to the most tokens a step holds);
  padded tokens write their K/V to the dummy block and belong to no request;
- its requests (rows) at fixed addresses, up to a row bucket: their token offsets (`cu_q_lens`), lengths
  and block tables; rows past the step's requests have no tokens;
- the attention grid: step 06's prefill kernel launches `rows x (longest chunk / 64)` programs, a host
  figure a graph would freeze. Here the grid is a list of (request, tile of 64 rows) pairs in device memory,
  as long as the worst case of the bucket (`max_tiles`): unused entries name no request and return at once;
- logits only at each row's last token (`sample_index`), sampled as the decode graphs do.

Only a backend whose prefill can take that tile list is captured (`capturable_prefill`: `TileListTritonBackend`
below); with another one, mixed steps run on the same buffers eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from common.model import CausalLM
from common.sampling import SamplingParams, SamplingTensors, sample_rows
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import AttentionBackend, AttentionMetadata, TritonBackend
from step06_paged_attention.engine import PagedAttentionForward
from step12_cuda_graph.decode_graphs import (GREEDY, LOGITS, PAD_PARAMS, SAMPLED, GraphRecorder, PendingTokens,
                                             greedy_tokens)

TILE_ROWS = 64  # query rows a program of the tile kernel handles (step 06's prefill launch)
# A short prompt alone is padded to the smallest bucket: at 256, a 32-token prompt of the 7B computed 8 times its
# rows, and its first token took 2.2 to 2.5 decode steps. From 32, it pads at most to twice its length.
SMALLEST_TOKEN_BUCKET = 32
ROW_BUCKETS = (16, 64, 256)  # rows a mixed graph holds, up to the engine's max_num_seqs


def doubling_buckets(smallest: int, largest: int) -> list[int]:
    """`smallest`, twice that, and so on below `largest`, then `largest` itself."""
    sizes, size = [], smallest
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def mixed_token_buckets(max_tokens: int) -> list[int]:
    """Token counts that get graphs: 32, 64, 128, ... below `max_tokens`, and `max_tokens` itself."""
    return doubling_buckets(SMALLEST_TOKEN_BUCKET, max_tokens)


def mixed_row_buckets(max_rows: int) -> list[int]:
    return [r for r in ROW_BUCKETS if r < max_rows] + [max_rows]


def max_tiles(tokens: int, rows: int) -> int:
    """The most (request, tile) pairs `rows` requests of `tokens` tokens in all can make: each request's last
    tile may be partial, so at most one tile per request beyond tokens / TILE_ROWS."""
    return -(-tokens // TILE_ROWS) + rows


@dataclass
class MixedChunk:
    """What a mixed graph needs of one chunk: its tokens, where they start, and its request's block table."""

    token_ids: list[int]
    start: int
    table: list[int]
    samples: bool
    params: SamplingParams
    output_position: int  # the position in the output of the token it samples


class StaticMixedInputs:
    """A mixed step's integer inputs at fixed device addresses, refilled from pinned host memory by one copy:
    [token ids | positions | slots] over tokens, [cu_q_lens | lengths | sample rows] over rows, the tile list,
    then the block table, `rows` rows of `width` blocks."""

    def __init__(self, max_tokens: int, max_rows: int, width: int, block_size: int, dummy_block: int,
                 device: torch.device) -> None:
        self.max_tokens, self.max_rows, self.width = max_tokens, max_rows, width
        self.block_size, self.dummy_block = block_size, dummy_block
        self.tiles = max_tiles(max_tokens, max_rows)
        self.sizes = [max_tokens] * 3 + [max_rows + 1, max_rows, max_rows] + [self.tiles] * 2 + [max_rows * width]
        self.device_buffer = torch.zeros(sum(self.sizes), dtype=torch.int32, device=device)
        self.host_buffer = torch.zeros(sum(self.sizes), dtype=torch.int32, pin_memory=device.type == "cuda")
        self.copied: torch.cuda.Event | None = None
        (self.input_ids, self.positions, self.slot_mapping, self.cu_q_lens, self.seq_lens, self.sample_index,
         self.tile_request, self.tile_index, self.block_table) = self.views(self.device_buffer)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        parts = list(torch.split(buffer, self.sizes))
        parts[-1] = parts[-1].view(self.max_rows, self.width)
        return parts

    def fill(self, chunks: Sequence[MixedChunk], tokens: int, rows: int) -> None:
        """Chunks laid end to end in `tokens` token slots and `rows` rows; the rest is padding."""
        if self.copied is not None:
            self.copied.synchronize()  # the last copy out of the host buffer has run
        ids, positions, slots, cu_q, lens, sample, tile_request, tile_index, table = self.views(self.host_buffer)
        size, dummy = self.block_size, self.dummy_block
        flat_ids, flat_pos, flat_slots, offsets, ends, last_rows, tiles = [], [], [], [0], [], [], []
        for row, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            pos = range(chunk.start, chunk.start + n)
            flat_ids += chunk.token_ids
            flat_pos += pos
            flat_slots += [chunk.table[p // size] * size + p % size for p in pos]
            tiles += [(row, t) for t in range(-(-n // TILE_ROWS))]
            offsets.append(offsets[-1] + n)
            ends.append(chunk.start + n)
            last_rows.append(offsets[-1] - 1)
        pad = tokens - len(flat_ids)
        ids[:tokens] = torch.tensor(flat_ids + [0] * pad, dtype=torch.int32)
        positions[:tokens] = torch.tensor(flat_pos + [0] * pad, dtype=torch.int32)
        slots[:tokens] = torch.tensor(flat_slots + [dummy * size] * pad, dtype=torch.int32)
        extra_rows = rows - len(chunks)
        cu_q[: rows + 1] = torch.tensor(offsets + [offsets[-1]] * extra_rows, dtype=torch.int32)  # no tokens
        lens[:rows] = torch.tensor(ends + [0] * extra_rows, dtype=torch.int32)
        sample[:rows] = torch.tensor(last_rows + [0] * extra_rows, dtype=torch.int32)
        spare = max_tiles(tokens, rows) - len(tiles)
        tile_request[: len(tiles) + spare] = torch.tensor([r for r, _ in tiles] + [-1] * spare, dtype=torch.int32)
        tile_index[: len(tiles) + spare] = torch.tensor([t for _, t in tiles] + [0] * spare, dtype=torch.int32)
        # Row by row, each only as long as its own table: padding every row to the longest (a 16,000-token
        # prompt's 1,000 blocks) cost the host milliseconds a step. What lies past a row's blocks is never used:
        # the Triton kernels stop at the row's length, and the torch backend masks what it gathers there (ids
        # of real blocks from earlier steps, so finite values). Rows past the chunks have no tokens.
        for row, chunk in enumerate(chunks):
            table[row, : len(chunk.table)] = torch.tensor(chunk.table, dtype=torch.int32)
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)
        if self.device_buffer.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()


class TileListTritonBackend(TritonBackend):
    """Step 06's Triton backend, whose prefill can also run over a tile list in device memory: capturable."""

    capturable_prefill = True

    def prefill_tiles(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      tile_request: torch.Tensor, tile_index: torch.Tensor) -> torch.Tensor:
        from step12_cuda_graph.prefill_tiles import paged_prefill_tiles  # Triton is optional

        return paged_prefill_tiles(q, k_cache, v_cache, meta.block_table, meta.cu_q_lens, meta.seq_lens,
                                   tile_request, tile_index, TILE_ROWS)


class MixedGraphForward(PagedAttentionForward):
    """Step 06's paged attention, with the prefill kernel launched over a tile list where the backend can
    (`capturable_prefill`), so that a graph can hold it; other backends run their own prefill, eagerly."""

    def __init__(self, cache: PagedKVCache, backend: AttentionBackend, meta: AttentionMetadata,
                 positions: torch.Tensor, tile_request: torch.Tensor, tile_index: torch.Tensor) -> None:
        super().__init__(cache, backend, meta, positions)
        self.tile_request, self.tile_index = tile_request, tile_index

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.backend.capturable_prefill:
            # The padded tokens past the last chunk belong to no request, so the backend computes nothing for
            # them: their output would be uninitialized (NaN, perhaps), become the K/V they write to the dummy
            # block, and poison a later masked read of it (0 x NaN is NaN). Zero it, from the device offsets.
            out = super().attend(layer_idx, q, k, v)
            padded = torch.arange(q.shape[0], device=q.device) >= self.meta.cu_q_lens[-1]
            return out.masked_fill(padded[:, None, None], 0.0)
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        self.backend.write_kv(k_cache, v_cache, k, v, self.meta)
        return self.backend.prefill_tiles(q, k_cache, v_cache, self.meta, self.tile_request, self.tile_index)


class MixedStepGraphs:
    """The mixed forward (embedding, layers, logits at each row's last token, sampling) on static buffers,
    captured per token bucket, row bucket and sampling mode, then replayed."""

    name = "mixed"  # the steps it replays, as `describe` says
    outputs = (GREEDY, SAMPLED, LOGITS)  # what its graphs leave behind (see `decode_graphs`)

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: AttentionBackend, max_model_len: int,
                 dummy_block: int, max_tokens: int, max_rows: int, capture: bool) -> None:
        self.model, self.cache, self.backend = model, cache, backend
        self.device = model.device
        self.token_buckets = self.token_buckets_for(max_tokens)
        self.row_buckets = mixed_row_buckets(max_rows)
        self.inputs = StaticMixedInputs(max_tokens, max_rows, cache.blocks_for(max_model_len), cache.block_size,
                                        dummy_block, self.device)
        vocab = model.config.vocab_size
        self.sampling = SamplingTensors.build([PAD_PARAMS] * max_rows, [0] * max_rows, vocab, self.device)
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(self.logit_rows(max_tokens, max_rows), vocab, device=self.device)
        self.graphs: dict[tuple[int, int, str], torch.cuda.CUDAGraph] = {}
        self.capture_seconds, self.capture_bytes = 0.0, 0
        # A backend whose prefill reads host figures (lengths, the longest chunk) would have them frozen by a
        # graph: its mixed steps run on the same buffers, eagerly.
        if capture and backend.capturable_prefill:
            self.capture_all()

    @staticmethod
    def token_buckets_for(max_tokens: int) -> list[int]:
        return mixed_token_buckets(max_tokens)

    @staticmethod
    def logit_rows(max_tokens: int, max_rows: int) -> int:
        """How many rows of logits a LOGITS graph writes at most: one per row, at its last token."""
        return max_rows

    def reachable(self, tokens: int, rows: int) -> bool:
        """Whether a step of at most `tokens` tokens can need the row bucket `rows` (each row has a token)."""
        smaller = [r for r in self.row_buckets if r < rows]
        return not smaller or smaller[-1] < tokens

    def fits(self, num_tokens: int, num_rows: int) -> bool:
        return num_tokens <= self.token_buckets[-1] and num_rows <= self.row_buckets[-1]

    @torch.inference_mode()
    def forward(self, tokens: int, rows: int, output: str, host_lens: tuple[list[int], list[int]] = ([], [])
                ) -> None:
        """What one graph holds: `tokens` token slots and `rows` rows of the static inputs in, `rows` tokens out.
        `host_lens`: the real rows' new tokens and lengths, for a backend that reads them on the host, eagerly
        (a graph holds none: a capturable prefill reads every length from the device)."""
        s = self.inputs
        q_lens, seq_lens_host = host_lens
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=s.slot_mapping[:tokens], block_table=s.block_table[:rows],
            seq_lens=s.seq_lens[:rows], cu_q_lens=s.cu_q_lens[: rows + 1], q_lens=q_lens,
            seq_lens_host=seq_lens_host, max_q_len=tokens, max_seq_len=max(seq_lens_host, default=0),
            block_size=s.block_size,
        )
        ntiles = max_tiles(tokens, rows)
        context = self.context(meta, s.positions[:tokens], s.tile_request[:ntiles], s.tile_index[:ntiles])
        self.write_outputs(self.model(s.input_ids[:tokens], context), tokens, rows, output)

    def context(self, meta: AttentionMetadata, positions: torch.Tensor, tile_request: torch.Tensor,
                tile_index: torch.Tensor) -> MixedGraphForward:
        return MixedGraphForward(self.cache, self.backend, meta, positions, tile_request, tile_index)

    def write_outputs(self, hidden: torch.Tensor, tokens: int, rows: int, output: str) -> None:
        """A token per row, from the logits at its last token, into the static `self.tokens` (or, for LOGITS, those
        logits into `self.logits`)."""
        last = self.last_tokens(hidden, rows)
        if output == SAMPLED:
            params = SamplingTensors(**{f.name: getattr(self.sampling, f.name)[:rows] for f in fields(SamplingTensors)})
            self.tokens[:rows] = sample_rows(self.model.compute_logits(last), params)
        elif output == LOGITS:
            self.logits[:rows] = self.model.compute_logits(last)
        else:
            self.tokens[:rows] = self.greedy_tokens(last)

    def last_tokens(self, hidden: torch.Tensor, rows: int) -> torch.Tensor:
        """The hidden state at each row's last token (a seam: step 13's model hands out its stream otherwise)."""
        return hidden[self.inputs.sample_index[:rows]]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """As step 12's decode graphs find a greedy token (step 13 overrides both alike)."""
        return greedy_tokens(self.model, hidden)

    def capture_all(self) -> None:
        """Record every bucket's graphs, largest first, in one memory pool (they never run at once)."""
        recorder = GraphRecorder(self.device)
        for tokens in reversed(self.token_buckets):
            for rows in [r for r in reversed(self.row_buckets) if self.reachable(tokens, r)]:
                # One padding chunk on the dummy block: the capture writes nothing a request reads.
                self.inputs.fill([MixedChunk([0], 0, [self.inputs.dummy_block], False, PAD_PARAMS, 0)], tokens, rows)
                for output in self.outputs:
                    self.graphs[tokens, rows, output] = recorder.record(
                        lambda: self.forward(tokens, rows, output))  # noqa: B023 - called at once
        self.capture_seconds, self.capture_bytes = recorder.finish()

    def launch(self, chunks: Sequence[MixedChunk]) -> PendingTokens:
        """Fill the static inputs, replay the graph of the smallest buckets that hold the chunks (or run the same
        forward eagerly), without waiting. Row i's token is chunk i's (meaningful where the chunk samples)."""
        tokens, rows = self.place(chunks)
        output = GREEDY if all(c.params.greedy for c in chunks if c.samples) else SAMPLED
        if output == SAMPLED:
            padded = [c.params if c.samples else PAD_PARAMS for c in chunks] + [PAD_PARAMS] * (rows - len(chunks))
            positions = [c.output_position for c in chunks] + [0] * (rows - len(chunks))
            host = SamplingTensors.build(padded, positions, self.model.config.vocab_size, torch.device("cpu"))
            pinned = self.device.type == "cuda"
            for f in fields(SamplingTensors):
                field = getattr(host, f.name)
                getattr(self.sampling, f.name)[:rows].copy_(field.pin_memory() if pinned else field, non_blocking=pinned)
        self.replay(chunks, tokens, rows, output)
        return PendingTokens(self.tokens[: len(chunks)])

    def logits_for(self, chunks: Sequence[MixedChunk]) -> torch.Tensor:
        """Replay the LOGITS graph for the chunks: row i holds the logits at chunk i's last token."""
        tokens, rows = self.place(chunks)
        self.replay(chunks, tokens, rows, LOGITS)
        return self.logits[: len(chunks)]

    def place(self, chunks: Sequence[MixedChunk]) -> tuple[int, int]:
        """Fill the static inputs in the smallest token and row buckets that hold the chunks; return those."""
        num_tokens = sum(len(c.token_ids) for c in chunks)
        tokens = next(b for b in self.token_buckets if b >= num_tokens)
        rows = next(b for b in self.row_buckets if b >= len(chunks))
        self.inputs.fill(chunks, tokens, rows)
        return tokens, rows

    def replay(self, chunks: Sequence[MixedChunk], tokens: int, rows: int, output: str) -> None:
        graph = self.graphs.get((tokens, rows, output))
        if graph is not None:
            graph.replay()
        else:  # eager: no CUDA, or a backend a graph cannot hold
            self.forward(tokens, rows, output,
                         ([len(c.token_ids) for c in chunks], [c.start + len(c.token_ids) for c in chunks]))

    def describe(self) -> str:
        if not self.graphs:
            return (f"{self.name} steps on static buffers, eager (token buckets {self.token_buckets}, "
                    f"rows {self.row_buckets})")
        return (f"{len(self.graphs)} {self.name}-step graphs (token buckets {self.token_buckets}, rows {self.row_buckets}) "
                f"captured in {self.capture_seconds:.1f} s, {self.capture_bytes / 2**20:.0f} MiB")
