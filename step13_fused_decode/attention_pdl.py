"""Step 06's attention kernels, launched with programmatic dependent launch (`dependent_launch.py`).

Each kernel here waits for the kernel before it, lets the one after it be placed early, and then runs
step 06's kernel as it is: a Triton kernel can be called from another one, where it is inlined. So the
bodies are step 06's, and so are the launches (grids, strides, scratch buffers): `PDLPagedAttentionKernels`
only names these kernels in place of step 06's and launches them with `launch_pdl`. Launched early, the
decode kernel lets the o projection after it be placed early too (measured: `step12_cuda_graph/README.md`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from step06_paged_attention.triton_kernels import (PagedAttentionKernels, merge_splits_kernel,
                                                   paged_decode_split_kernel, kv_write_kernel)
from step12_cuda_graph.mixed_graphs import TileListTritonBackend
from step13_fused_decode.dependent_launch import wait_for_previous_kernel


@triton.jit
def _write_kv_pdl_kernel(K_NEW, V_NEW, K_CACHE, V_CACHE, SLOTS, stride_k_t, stride_v_t, stride_slot,
                         ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    wait_for_previous_kernel(True)
    kv_write_kernel(K_NEW, V_NEW, K_CACHE, V_CACHE, SLOTS, stride_k_t, stride_v_t, stride_slot, ROW, ROW_PAD)


@triton.jit
def _paged_decode_split_pdl_kernel(Q, K_CACHE, V_CACHE, BLOCK_TABLE, SEQ_LENS, ACC, M, L, ARRIVED, OUT, scale,
                                   stride_qb, stride_qh, stride_bt, stride_slot, stride_acc_b, stride_acc_h,
                                   stride_acc_s, stride_ob, stride_oh, NUM_SPLITS: tl.constexpr,
                                   MERGE_HERE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                                   PRECISION: tl.constexpr):
    wait_for_previous_kernel(True)
    paged_decode_split_kernel(Q, K_CACHE, V_CACHE, BLOCK_TABLE, SEQ_LENS, ACC, M, L, ARRIVED, OUT, scale, stride_qb,
                               stride_qh, stride_bt, stride_slot, stride_acc_b, stride_acc_h, stride_acc_s, stride_ob,
                               stride_oh, NUM_SPLITS, MERGE_HERE, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, TILE,
                               PRECISION)


@triton.jit
def _merge_splits_pdl_kernel(ACC, M, L, OUT, stride_acc_b, stride_acc_h, stride_acc_s, stride_ob, stride_oh,
                             NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    wait_for_previous_kernel(True)
    merge_splits_kernel(ACC, M, L, OUT, stride_acc_b, stride_acc_h, stride_acc_s, stride_ob, stride_oh,
                         NUM_SPLITS, SPLITS_PAD, HEAD_DIM)


class LaunchedWithPDL:
    """A kernel that `kernel[grid](...)` launches with programmatic dependent launch."""

    def __init__(self, kernel: triton.JITFunction) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **kwargs, launch_pdl=True)


class PDLPagedAttentionKernels(PagedAttentionKernels):
    write_kv_kernel = LaunchedWithPDL(_write_kv_pdl_kernel)
    decode_kernel = LaunchedWithPDL(_paged_decode_split_pdl_kernel)
    merge_kernel = LaunchedWithPDL(_merge_splits_pdl_kernel)


class PDLTritonBackend(TileListTritonBackend):
    """Step 12's Triton backend with its KV-write and decode kernels launched with PDL (prefill unchanged)."""

    def __init__(self, num_sms: int, max_batch: int = 256) -> None:
        super().__init__(num_sms, max_batch)
        self.kernels = PDLPagedAttentionKernels()

