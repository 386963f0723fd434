"""Step 03: step 02's engine with the vectorized gather and write-back of `kv_cache.py`. Nothing else changes."""

from step02_paged_kv.engine import PagedEngine
from step03_vectorized_gather.kv_cache import VectorizedDecodeForward, VectorizedPrefillForward


class VectorizedGatherEngine(PagedEngine):
    prefill_context = VectorizedPrefillForward
    decode_context = VectorizedDecodeForward
