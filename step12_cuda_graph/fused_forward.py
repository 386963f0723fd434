"""Step 06's paged-attention context with fewer, larger kernels per layer (`--fused-ops`).

The model asks its forward context for its projections, RMSNorm, RoPE and the gated activation
(`common/model.py`); the defaults are plain PyTorch. This context answers with one matrix multiply for the
projections that share an input (`packed_projections.py`) and one Triton kernel for each element-wise
chain (`fused_kernels.py`), for the decode graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from common.model import RMSNorm
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import AttentionBackend, AttentionMetadata
from step06_paged_attention.engine import PagedAttentionForward
from step12_cuda_graph import fused_kernels
from step12_cuda_graph.packed_projections import PackedProjections


class FusedOpsForward(PagedAttentionForward):
    def __init__(self, cache: PagedKVCache, backend: AttentionBackend, meta: AttentionMetadata,
                 positions: torch.Tensor, packed: PackedProjections, pdl: bool = False) -> None:
        super().__init__(cache, backend, meta, positions)
        self.packed = packed
        self.pdl = pdl  # launch the element-wise kernels with programmatic dependent launch

    def project(self, x: torch.Tensor, projections: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
        return self.packed(x, projections)

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return fused_kernels.rms_norm(x, norm.weight, norm.eps, pdl=self.pdl)

    def add_rms_norm(self, norm: RMSNorm, x: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_kernels.add_rms_norm(x, update, norm.weight, norm.eps, pdl=self.pdl)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_kernels.rotate(q, k, cos, sin, pdl=self.pdl)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return fused_kernels.silu_mul(gate, up, pdl=self.pdl)
