"""For each exercise, one plausible wrong answer that skips the step's idea, with the stub's signature.

`tests/test_exercises.py` swaps each in as the runner swaps in a learner's function and checks that the
exercise's selected tests fail on it: a selection that let one of these pass would call a learner's code
solved while it misses what the step teaches. The registry's `skips_idea` says each in a line for the README.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.model import DecoderLayer
from common.profiling.trace import SYNC_CALLS, Event
from common.request import RequestStatus
from step01_serial.kv_cache import ContiguousForward
from step02_paged_kv.block_allocator import OutOfBlocksError
from step02_paged_kv.kv_cache import PagedKVCache
from step03_vectorized_gather.kv_cache import VectorizedDecodeForward
from step04_multi_gpu.sharding import columns_of, split_linear
from step06_paged_attention.backends import TorchBackend
from step07_preemption.engine import PreemptibleRequest, PreemptionEngine
from step09_chunked_prefill.engine import Chunk, ChunkedPrefillEngine, ChunkedRequest
from step10_prefix_caching.block_pool import ROOT_KEY, PrefixCachingAllocator, block_key
from step10_prefix_caching.engine import PrefixCachedRequest, PrefixCachingEngine
from step11_speculative_decoding.engine import SpeculativeEngine, SpeculativeRequest
from step12_cuda_graph.decode_graphs import DecodeBatch, StaticDecodeInputs
from step14_overlap_scheduling.engine import LaunchAheadBatch, LaunchedDecode, OverlapSchedulingEngine
# The project's own function, bound when this module is imported, before any exercise swaps it on its module.
from step15_batch_invariant.attention import split_attention as project_split_attention


def attend_to_new_tokens_only(self: ContiguousForward, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor) -> torch.Tensor:
    """Stores the new K/V but attends over the new tokens alone: a decoded token never sees its prompt."""
    self.cache.k[layer_idx, self.start : self.end] = k
    self.cache.v[layer_idx, self.start : self.end] = v
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


def slot_is_the_position(self: PagedKVCache, block_table: list[int], position: int) -> int:
    """Ignores the block table: as if every request's blocks started at block 0, one after another."""
    return position


def gather_consecutive_blocks(self: VectorizedDecodeForward, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One indexing operation, but as if each request's blocks followed its first one in the pool."""
    first = self.block_table[:, :1]
    blocks = (first + torch.arange(self.max_blocks, device=first.device)) % self.cache.k.shape[1]
    batch = len(self.seq_lens)
    keys = self.cache.k[layer_idx][blocks].reshape(batch, -1, *self.cache.k.shape[3:])[:, : self.max_len]
    values = self.cache.v[layer_idx][blocks].reshape(batch, -1, *self.cache.v.shape[3:])[:, : self.max_len]
    return keys, values


@torch.no_grad()
def shard_layer_without_all_reduce(layer: DecoderLayer, rank: int, size: int, group: dist.ProcessGroup | None) -> None:
    """Cuts every weight as it should, but leaves o_proj and down_proj plain nn.Linear: each rank keeps its
    partial sum, and no all-reduce adds them up."""
    attention, mlp = layer.self_attn, layer.mlp
    for projection in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
        split_linear(projection, rank, size)
    attention.num_heads //= size
    attention.num_kv_heads //= size
    for linear in (attention.o_proj, mlp.down_proj):
        linear.weight = nn.Parameter(columns_of(linear.weight.data, rank, size), requires_grad=False)
        linear.in_features //= size


def own_time_less_every_nested_range(ranges: list[Event]) -> list[tuple[Event, float, int]]:
    """Takes every range inside a range off its time, not only those directly inside: deep time counts twice."""
    ordered = sorted(ranges, key=lambda e: (e.start, -e.dur))
    result = []
    for r in ordered:
        inside = [o for o in ordered if o is not r and r.start <= o.start and o.end <= r.end and o.dur < r.dur]
        holders = [o for o in ordered if o is not r and o.start <= r.start and r.end <= o.end and o.dur > r.dur]
        result.append((r, r.dur - sum(o.dur for o in inside), len(holders)))
    return result


def count_no_syncs_on_a_cpu(events: list[Event], on_gpu: bool) -> int:
    """Counts the CUDA calls on a GPU, and nothing on a CPU ("no device to wait for"): the reads that would
    stall a GPU go unseen without one."""
    if not on_gpu:
        return 0
    return sum(1 for e in events if e.cat in ("cuda_runtime", "cuda_driver") and e.name in SYNC_CALLS)


def merge_without_rescaling(self: TorchBackend, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Adds the parts' sums as they are, each exponential still relative to its own part's max."""
    return acc.sum(-2) / l.sum(-1, keepdim=True)


def pick_oldest_victim(self: PreemptionEngine,
                       less_important_than: PreemptibleRequest | None = None) -> PreemptibleRequest | None:
    """The least important, but among equals the oldest admission: the request that has done the most work."""
    candidates = [r for r in self.running
                  if less_important_than is None or r.priority > less_important_than.priority]
    return max(candidates, key=lambda r: (r.priority, -r.admitted_at)) if candidates else None


def preempt_as_if_computed(self: PreemptionEngine, victim: PreemptibleRequest) -> None:
    """Frees and swaps or requeues every victim alike: a request admitted a moment ago, never prefilled, is
    counted as preempted and has its empty blocks swapped out."""
    self.running.remove(victim)
    table, victim.block_table = victim.block_table, []
    self._not_prefilled.discard(victim)
    self.preemptions += 1
    if self.config.preempt == "swap":
        victim.host_kv = self.swapper.swap_out(table)
        victim.status = RequestStatus.SWAPPED
        self.swapped.append(victim)
    else:
        victim.status = RequestStatus.WAITING
        self.waiting.append(victim)
    self.allocator.free(table)


def fill_budget_prefill_first(self: ChunkedPrefillEngine, decoders: list[ChunkedRequest]) -> list[Chunk]:
    """Gives the whole budget to prompt chunks, the decoders' tokens on top: a step runs past its budget."""
    left, chunks = self.token_budget, []
    candidates = [r for r in self.running if not self.is_decoding(r)] + list(self.waiting)
    for request in sorted(candidates, key=self.importance):
        if left <= 0:
            break
        chunk = self.next_chunk(request, left)
        if chunk is not None:
            chunks.append(chunk)
            left -= chunk.num_tokens
    return chunks


def key_blocks_without_the_prefix(self: PrefixCachingEngine, request: PrefixCachedRequest, end: int) -> None:
    """Keys each full block by its own tokens alone: two prompts that share one block's tokens, but not what
    comes before it, share its (wrong) K/V."""
    size = self.cache.block_size
    for i in range(len(request.block_keys), end // size):
        key = block_key(ROOT_KEY, request.all_token_ids[i * size : (i + 1) * size])
        request.block_keys.append(key)
        self.allocator.register(request.block_table[i], key)


def evict_most_recently_used(self: PrefixCachingAllocator, n: int) -> list[int]:
    """Evicts the newest cached block first: the prefix most likely to be asked for again goes first."""
    if n > self.num_free:
        raise OutOfBlocksError(f"asked for {n} blocks, {self.num_free} free or cached")
    blocks = []
    for _ in range(n):
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.cached.popitem(last=True)
            del self.block_of_key[self.key_of_block.pop(block)]
            self.evictions += 1
        self.ref_counts[block] = 1
        self.owned.add(block)
        blocks.append(block)
    return blocks


def accept_every_proposal(proposals: list[int], target_tokens: list[int]) -> list[int]:
    """Keeps every proposal, then the target's last token: whatever the draft wrote is emitted."""
    return [*proposals, target_tokens[-1]]


def propose_up_to_the_limit(self: SpeculativeEngine, decoders: list[SpeculativeRequest], limits: list[int],
                            step_tokens: int) -> list[int]:
    """Checks as many proposals as each decoder may, whether they pay for their cost or not."""
    room = max(0, self.speculation_token_limit() - step_tokens)
    counts = []
    for limit in limits:
        counts.append(min(limit, room))
        room -= counts[-1]
    return counts


def pad_rows_onto_block_zero(self: StaticDecodeInputs, batch: DecodeBatch, bucket: int) -> None:
    """Lays out the batch's rows right, but pads with zeros everywhere: a padded row writes its K/V into
    block 0, which a request owns."""
    pad, size = bucket - len(batch), self.block_size
    positions = [n - 1 for n in batch.seq_lens]
    slots = [t[p // size] * size + p % size for t, p in zip(batch.tables, positions)]
    used = max((len(t) for t in batch.tables), default=1)
    self.host["input_ids"][:bucket] = torch.tensor([*batch.token_ids, *[0] * pad], dtype=torch.int32)
    self.host["positions"][:bucket] = torch.tensor([*positions, *[0] * pad], dtype=torch.int32)
    self.host["seq_lens"][:bucket] = torch.tensor([*batch.seq_lens, *[1] * pad], dtype=torch.int32)
    self.host["slot_mapping"][:bucket] = torch.tensor([*slots, *[0] * pad], dtype=torch.int32)
    rows = [t + [0] * (used - len(t)) for t in batch.tables] + [[0] * used] * pad
    self.host["block_table"][:bucket, :used] = torch.tensor(rows, dtype=torch.int32)


def norm_without_the_residual(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float,
                              pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the sum, but normalises the sublayer's output alone, without the residual added."""
    normed = update.float() * torch.rsqrt(update.float().pow(2).mean(-1, keepdim=True) + eps)
    return x + update, weight * normed.to(x.dtype)


def launch_after_reading_the_tokens(self: OverlapSchedulingEngine, requests: list[SpeculativeRequest],
                                    previous: LaunchedDecode | None = None) -> LaunchedDecode:
    """Waits for the step before to read its tokens, then launches from the host as step 12 does: the same
    tokens, but the host stalls on the device every step and nothing overlaps."""
    assert self.graphs is not None
    known = dict(zip(previous.requests, previous.tokens.wait())) if previous is not None else {}
    batch = LaunchAheadBatch([], [], [], [], [], [])
    for request in requests:
        pending = int(request in known)
        batch.token_ids.append(known[request] if pending else request.output_token_ids[-1])
        batch.previous_rows.append(-1)
        batch.seq_lens.append(request.num_tokens + pending)
        batch.output_positions.append(len(request.output_token_ids) + pending)
        self.grow_block_table(request, batch.seq_lens[-1])
        batch.tables.append(request.block_table)
        batch.params.append(request.params)
    return LaunchedDecode(requests, batch.seq_lens, *self.launch_rows(batch, requests))


def linear_on_the_whole_batch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Hands the library the batch's own shape: its method, and so a row's bits, follow the batch size."""
    return F.linear(x, weight, bias)


def attention_in_two_pieces(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: torch.Tensor,
                            split: int = 32) -> torch.Tensor:
    """The running softmax, but in a fixed number of pieces (two, as a split-K decode cuts them) instead of pieces
    of a fixed size: where a row's pieces end follows the batch's width, and so do its bits."""
    return project_split_attention(q, keys, values, query_pos, split=keys.shape[1] // 2)


def bits_from_the_top(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpacks each word from its most significant bit down: token 32 w + j read from bit 31 - j."""
    shifts = 31 - torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def scale_as_for_int8(weight: torch.Tensor, per_row: bool = True) -> Any:
    """Scales each row to 127, int8's largest value: the weights then use a sliver of e4m3's range."""
    from step17_fp8_weights.fp8 import E4M3, Fp8Weight

    weight = weight.float()
    largest = weight.abs().amax(dim=1) if per_row else weight.abs().amax().reshape(1)
    scale = (largest / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return Fp8Weight((weight / scale[:, None]).to(E4M3), scale)


WRONG_ANSWERS: dict[str, Callable[..., Any]] = {
    "01-contiguous-attend": attend_to_new_tokens_only,
    "02-slot-mapping": slot_is_the_position,
    "03-vectorized-gather": gather_consecutive_blocks,
    "04-shard-layer": shard_layer_without_all_reduce,
    "05-own-time": own_time_less_every_nested_range,
    "05-count-syncs": count_no_syncs_on_a_cpu,
    "06-merge-splits": merge_without_rescaling,
    "07-choose-victim": pick_oldest_victim,
    "07-preempt": preempt_as_if_computed,
    "09-token-budget": fill_budget_prefill_first,
    "10-block-keys": key_blocks_without_the_prefix,
    "10-lru-evict": evict_most_recently_used,
    "11-accept-greedy": accept_every_proposal,
    "11-proposal-counts": propose_up_to_the_limit,
    "12-graph-bucket": pad_rows_onto_block_zero,
    "13-add-rmsnorm": norm_without_the_residual,
    "14-launch-decode": launch_after_reading_the_tokens,
    "15-row-tiles": linear_on_the_whole_batch,
    "15-split-attention": attention_in_two_pieces,
    "16-bitmask": bits_from_the_top,
    "17-quantize": scale_as_for_int8,
}
