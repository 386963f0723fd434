"""What kind of work a GPU kernel does, from its name: the profile's only clue once a kernel runs.

Kernel names come from whoever wrote them: cuBLAS and CUTLASS name their matrix multiplies after tiles and
architectures (`sm90_xmma_gemm_...`, `nvjet_...`), PyTorch its element-wise loops (`vectorized_elementwise_kernel`),
Triton after the Python function (`paged_decode_split_kernel`). The lists below cover the kernels this
project's steps launch; anything else counts as "other", and the profile's tables name the costliest kernels so
a new one is seen.
"""

from __future__ import annotations

MATMUL = "matrix multiply"
ATTENTION = "attention"
ELEMENTWISE = "element-wise and reductions"

# Our attention kernels, by how their names begin (leading underscores aside): step 06's
# paged_decode_split_kernel, merge_splits_kernel, kv_write_kernel and _paged_prefill_kernel, step 12's
# _paged_prefill_tiles_kernel and step 13's PDL twins. A prefix, not a substring: step 13's fused
# _rope_and_kv_write_kernel is element-wise work that happens to write the cache.
OUR_ATTENTION = ("paged_decode", "merge_splits", "write_kv", "kv_write", "paged_prefill")
LIBRARY_ATTENTION = ("fmha", "flash", "scaled_dot_product", "attention")  # PyTorch's SDPA, flash-attn
CATEGORIES = {  # after attention, the first match wins, anywhere in the lower-cased name
    MATMUL: ("gemm", "gemv", "cutlass", "sm90_", "cublas", "splitk", "nvjet", "_skinny_matmul"),
    ELEMENTWISE: ("elementwise", "vectorized", "reduce", "index", "cat", "copy", "fill", "norm", "silu", "rope",
                  "softmax", "argmax", "embed"),
}


def category_of(kernel: str) -> str:
    name = kernel.lower()
    if name.lstrip("_").startswith(OUR_ATTENTION) or any(key in name for key in LIBRARY_ATTENTION):
        return ATTENTION
    return next((c for c, keys in CATEGORIES.items() if any(k in name for k in keys)), "other")
