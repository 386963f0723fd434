"""Step 06's paged prefill kernel launched over a list of (request, tile) pairs read from device memory.

Step 06 launches `requests x tiles of the longest chunk x heads` programs: the grid comes from host numbers
that change with every step, so a CUDA graph could not hold it. Here the grid is the length of a tile list
the host fills before each replay (`StaticMixedInputs`), sized for the worst case of a graph's bucket; an
entry that names no request (-1) returns at once. Each program then runs step 06's own tile body.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from step06_paged_attention.triton_kernels import attend_causally, dot_precision, prefill_tile


@triton.jit
def _paged_prefill_tiles_kernel(Q, K_CACHE, V_CACHE, BLOCK_TABLE, CU_Q, CONTEXT_LENS, TILE_REQUEST, TILE_INDEX,
                                OUT, scale, stride_qt, stride_qh, stride_bt, stride_slot, stride_ot, stride_oh,
                                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                BLOCK_M: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
                                ATTEND: tl.constexpr):
    entry = tl.program_id(0)
    request = tl.load(TILE_REQUEST + entry)
    if request >= 0:
        prefill_tile(Q, K_CACHE, V_CACHE, BLOCK_TABLE, CU_Q, CONTEXT_LENS, OUT, scale, request,
                      tl.load(TILE_INDEX + entry), tl.program_id(1), stride_qt, stride_qh, stride_bt, stride_slot,
                      stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_M, TILE, PRECISION, ATTEND)


def paged_prefill_tiles(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        cu_q_lens: torch.Tensor, context_lens: torch.Tensor, tile_request: torch.Tensor,
                        tile_index: torch.Tensor, block_m: int, tile: int = 64, num_warps: int = 4,
                        num_stages: int = 3, attend: triton.JITFunction = attend_causally) -> torch.Tensor:
    """As step 06's `paged_prefill`, one program per entry of the tile list and head: entry i computes query
    rows `tile_index[i] * block_m ..` of request `tile_request[i]` (-1: nothing). Rows of `q` that no entry
    covers (padding) are zeros: a padded token's K/V, written to the dummy block, must stay finite."""
    total, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.zeros_like(q)
    _paged_prefill_tiles_kernel[(tile_request.shape[0], heads)](
        q, k_cache, v_cache, block_table, cu_q_lens, context_lens, tile_request, tile_index, out, head_dim**-0.5,
        q.stride(0), q.stride(1), block_table.stride(0), kv_heads * head_dim, out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE=tile,
        PRECISION=dot_precision(q.dtype), ATTEND=attend, num_warps=num_warps, num_stages=num_stages,
    )
    return out
