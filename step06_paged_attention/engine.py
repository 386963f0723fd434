"""Step 06: attention reads K/V straight from the block pool; prompts are prefilled together.

Against step 02/03, `PagedAttentionEngine` changes two things:
- `make_decode_context`: the decode forward carries `AttentionMetadata` (block table, lengths, slot
  mapping as device tensors, built once) to an attention backend instead of gathering K/V into a copy;
- `prefill_admitted`: every request admitted in a step is prefilled in ONE forward, their prompts laid end
  to end (a variable-length batch), instead of one forward each (`--no-batched-prefill` keeps one each, so
  that the two changes can be measured apart).
Scheduling, the block allocator and the pool are step 02's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.loading import LoadedModel
from common.model import ForwardContext
from common.request import RequestOutput
from step02_paged_kv.engine import PagedEngine, PagedEngineConfig, PagedRequest
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import BACKENDS, AttentionBackend, AttentionMetadata, create_backend


@dataclass
class PagedAttentionEngineConfig(PagedEngineConfig):
    attn: str = "auto"  # auto | torch | triton | flash_attn
    sync_per_layer: bool = False  # ablation: recompute the longest length with .item() in every layer
    batched_prefill: bool = True  # off: one prefill forward per prompt, as step 03 (to measure each change)


class PagedAttentionForward(ForwardContext):
    def __init__(self, cache: PagedKVCache, backend: AttentionBackend, meta: AttentionMetadata,
                 positions: torch.Tensor, sync_per_layer: bool = False) -> None:
        self.cache = cache
        self.backend = backend
        self.meta = meta
        self.positions = positions
        self.sync_per_layer = sync_per_layer

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        if self.sync_per_layer:
            # A classic bug, kept as a switch to measure it: asking the device for a figure the
            # host already knows stalls the CPU until the GPU has finished all queued work, in every layer.
            meta.max_seq_len = int(meta.seq_lens.max().item())
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        self.backend.write_kv(k_cache, v_cache, k, v, meta)
        if meta.is_prefill:
            return self.backend.prefill(q, k_cache, v_cache, meta)
        return self.backend.decode(q, k_cache, v_cache, meta)


class PagedAttentionEngine(PagedEngine):
    config_class = PagedAttentionEngineConfig
    splits_over_ranks = True  # step 04: its pool is one budget in blocks, taken once for every rank

    def __init__(self, loaded: LoadedModel, config: PagedAttentionEngineConfig) -> None:
        super().__init__(loaded, config)
        self.backend = create_backend(config.attn, self.device, config.block_size, config.max_num_seqs,
                                      self.backend_classes(config))

    def backend_classes(self, config: PagedAttentionEngineConfig) -> dict[str, type[AttentionBackend]]:
        """The backend class of each --attn name (a method: a later step maps a name to its own subclass)."""
        return BACKENDS

    def build_metadata(self, requests: list[PagedRequest], q_lens: list[int], seq_lens: list[int],
                       is_prefill: bool) -> tuple[AttentionMetadata, torch.Tensor]:
        """Everything the layers need, as tensors built in one go; returns it with the token positions."""
        device, size = self.device, self.cache.block_size
        tables = [r.block_table for r in requests]
        width = max(len(t) for t in tables)
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
        q_lens_t = torch.tensor(q_lens, device=device)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        cu_q_lens = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=device)
        cu_q_lens[1:] = q_lens_t.cumsum(0)
        # Each new token's request and position; its slot follows from the block table.
        # output_size: without it, repeat_interleave reads the counts' sum back from the device (a sync).
        total = sum(q_lens)
        owner = torch.repeat_interleave(torch.arange(len(q_lens), device=device), q_lens_t, output_size=total)
        first_new = seq_lens_t.long() - q_lens_t
        positions = first_new[owner] + torch.arange(total, device=device) - cu_q_lens[:-1].long()[owner]
        slots = block_table[owner, positions // size].long() * size + positions % size
        meta = AttentionMetadata(
            is_prefill=is_prefill, slot_mapping=slots, block_table=block_table, seq_lens=seq_lens_t,
            cu_q_lens=cu_q_lens, q_lens=q_lens, seq_lens_host=seq_lens, max_q_len=max(q_lens),
            max_seq_len=max(seq_lens), block_size=size,
        )
        return meta, positions

    def context(self, meta: AttentionMetadata, positions: torch.Tensor) -> PagedAttentionForward:
        return PagedAttentionForward(self.cache, self.backend, meta, positions, self.config.sync_per_layer)

    def make_decode_context(self, requests: list[PagedRequest], seq_lens: list[int]) -> ForwardContext:
        meta, positions = self.build_metadata(requests, [1] * len(requests), seq_lens, is_prefill=False)
        return self.context(meta, positions)

    def prefill_admitted(self, requests: list[PagedRequest]) -> list[RequestOutput]:
        if not self.config.batched_prefill:
            return [output for request in requests for output in self.prefill_together([request])]
        return self.prefill_together(requests)

    @torch.inference_mode()
    def prefill_together(self, requests: list[PagedRequest]) -> list[RequestOutput]:
        """One forward for all `requests`' prompts, laid end to end."""
        if not requests:
            return []
        token_ids = [r.all_token_ids for r in requests]  # nothing of these requests is cached yet
        lens = [len(t) for t in token_ids]
        for request, n in zip(requests, lens):
            if not request.block_table:  # a scheduler may have allocated them already
                request.block_table = self.allocator.allocate(self.cache.blocks_for(n))
        meta, positions = self.build_metadata(requests, lens, lens, is_prefill=True)
        flat = torch.tensor([t for ids in token_ids for t in ids], device=self.device)
        hidden = self.model(flat, self.context(meta, positions))
        last = meta.cu_q_lens[1:].long() - 1  # each request's last prompt token predicts its first output
        logits = self.model.compute_logits(hidden[last])
        return self.process_tokens(requests, self.sample(logits, requests))
