"""Step 06's paged-attention context with fewer, larger kernels per layer (`--fused-ops`).

The model asks its forward context for its projections (each with the RMSNorm before it or the residual add
after it), the heads' RMSNorm, RoPE together with attention, the gated activation and the greedy tokens
(`common/model.py`); the defaults are plain PyTorch. This context answers with one matrix multiply for the
projections that share an input (`packed_projections.py`) and one Triton kernel for each element-wise chain
(`fused_kernels.py`), for the decode graphs; RoPE's kernel also writes K and V into the cache. The kernel
that adds a projection to the residual stream also makes the stream ready for the norm that reads it next
(`PreparedNorm`): the add-and-norm kernel past 16 rows, and up to 16 rows the skinny matrix multiply itself,
and before the first layer the embedding lookup, so that no norm kernel runs there at all. Up to 16 rows, a
greedy step's output head returns the tokens from its skinny multiply (`greedy_tokens`): no logits are
written for another kernel to search.
"""

from __future__ import annotations

import torch
from torch import nn

from common.model import RMSNorm
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import AttentionBackend, AttentionMetadata
from step06_paged_attention.engine import PagedAttentionForward
from step06_paged_attention.triton_kernels import MERGE_IN_KERNEL_MAX_SPLITS
from step12_cuda_graph import fused_kernels
from step12_cuda_graph.packed_projections import PackedProjections, PreparedNorm


class FusedOpsForward(PagedAttentionForward):
    def __init__(self, cache: PagedKVCache, backend: AttentionBackend, meta: AttentionMetadata,
                 positions: torch.Tensor, packed: PackedProjections, pdl: bool = False) -> None:
        super().__init__(cache, backend, meta, positions)
        self.packed = packed
        self.pdl = pdl  # launch the element-wise kernels with programmatic dependent launch
        # Residual streams that the kernel adding to them also made ready for their next norm, by id()
        # (each entry holds its stream, so the id cannot be reused while it waits; it is used once).
        self.prepared: dict[int, PreparedNorm] = {}

    def project(self, x: torch.Tensor, projections: tuple[nn.Linear, ...], norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        packed = self.packed[projections]
        if residual is not None:
            prepared = packed.add(x, residual)
            self.prepared[id(prepared.stream)] = prepared
            return (prepared.stream,)
        if norm is None:
            return packed(x)
        return packed(*self.ready_for(norm, x))

    def greedy_tokens(self, x: torch.Tensor, head: nn.Linear, norm: RMSNorm) -> torch.Tensor:
        packed = self.packed[(head,)]
        if not packed.runs_skinny(x):
            return super().greedy_tokens(x, head, norm)
        return packed.argmax(*self.ready_for(norm, x))  # the tokens, from the head's kernel: no logits

    def ready_for(self, norm: RMSNorm, x: torch.Tensor) -> tuple[torch.Tensor, PreparedNorm | None]:
        """x and what a projection needs to take norm(x): the stream as the kernel that wrote it made it ready
        for this norm, or else norm(x) from a norm kernel."""
        prepared = self.prepared.pop(id(x), None)
        if prepared is None or prepared.norm is not norm:
            return self.rms_norm(norm, x), None  # embeddings the multiply cannot normalise: a norm kernel
        return x, prepared

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return fused_kernels.rms_norm(x, norm.weight, norm.eps, pdl=self.pdl)

    def embed(self, embedding: nn.Embedding, input_ids: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if not self.packed.normalises_in_matmul(input_ids.shape[0]):
            return super().embed(embedding, input_ids, norm)
        stream, scaled, squares = fused_kernels.embed_for_norm(input_ids, embedding.weight, norm.weight, self.pdl)
        self.prepared[id(stream)] = PreparedNorm(stream, norm, scaled=scaled, squares=squares)
        return stream

    def rotate_and_attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.meta.is_prefill:  # the graphs only decode; a prefill keeps step 06's path
            return super().rotate_and_attend(layer_idx, q, k, v, cos, sin)
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        # With PDL, the decode kernel is placed while this one still runs only where that was measured to pay
        # (H200, results/step12_cuda_graph/profile-...-decode-early-*.json): a decode kernel that merges its
        # own splits gained about 0.03 ms a step at batch 8; one followed by the merge kernel lost 0.1 ms.
        splits = self.backend.num_splits(q.shape[0], k_cache.shape[2], self.meta.max_seq_len)
        q = fused_kernels.rotate_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, self.meta.slot_mapping,
                                              pdl=self.pdl, decode_early=splits <= MERGE_IN_KERNEL_MAX_SPLITS)
        return self.backend.decode(q, k_cache, v_cache, self.meta)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return fused_kernels.silu_mul(gate, up, pdl=self.pdl)
