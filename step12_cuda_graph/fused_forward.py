"""Step 06's paged-attention context with the layer's element-wise chains as fused kernels (`--fused-ops`).

The model asks its forward context for RMSNorm, RoPE and the gated activation (`common/model.py`); the
defaults are plain PyTorch. This context answers with `fused_kernels.py` instead, for the decode graphs.
"""

from __future__ import annotations

import torch

from common.model import RMSNorm
from step06_paged_attention.engine import PagedAttentionForward
from step12_cuda_graph import fused_kernels


class FusedOpsForward(PagedAttentionForward):
    def rms_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return fused_kernels.rms_norm(x, norm.weight, norm.eps)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_kernels.rotate(q, k, cos, sin)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return fused_kernels.silu_mul(gate, up)
