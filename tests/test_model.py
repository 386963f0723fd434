"""Our decoder against Hugging Face transformers, and our KV-cached forwards against a full prefill.

The tolerance is float32 rounding: differences scale with the logits' magnitude, so the bound is relative
to the largest reference logit (measured: ~5e-7 on the tiny models, ~7e-5 on the embedded model's logits
of up to ~37, both far inside the bound; a wrong mask, RoPE or norm is off by orders of magnitude more).
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from common.loading import LoadedModel
from common.reference import hf_model_for, reference_logits
from common.tokenizer import Tokenizer
from step01_serial.kv_cache import ContiguousForward, ContiguousKVCache

# Multi-byte text (CJK, emoji, accents, Cyrillic) so that byte-fallback tokens are in the prompt.
PROMPT = "Translate to English: 你好，世界！🌍🚀 Ça va, café? Привет."
REL_TOL = 2e-5


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Fail unless every logit is within float32 rounding of the reference (relative to the logit scale)."""
    assert ours.shape == ref.shape
    scale = max(1.0, ref.abs().max().item())
    diff = (ours - ref).abs().max().item()
    assert diff <= REL_TOL * scale, f"max |ours - ref| = {diff:.3e} > {REL_TOL * scale:.3e} (logit scale {scale:.1f})"


def prompt_ids(loaded: LoadedModel) -> list[int]:
    ids = loaded.tokenizer.apply_chat_template(PROMPT)
    assert len(ids) > 40
    return ids


@torch.inference_mode()
def forward_chunks(loaded: LoadedModel, token_ids: list[int], chunk_sizes: list[int]) -> torch.Tensor:
    """Run `token_ids` through one contiguous cache in consecutive chunks; logits of every token, in order."""
    model = loaded.model
    assert sum(chunk_sizes) == len(token_ids)
    cache = ContiguousKVCache(model.config, len(token_ids), model.device, model.dtype)
    rows = []
    for size in chunk_sizes:
        ctx = ContiguousForward(cache, cache.length, size, model.device)
        chunk = torch.tensor(token_ids[cache.length : ctx.end], device=model.device)
        rows.append(model.compute_logits(model(chunk, ctx)))
        cache.length = ctx.end
    return torch.cat(rows)


def full_prefill(loaded: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    return forward_chunks(loaded, token_ids, [len(token_ids)])


def test_prompt_has_multibyte_tokens(tokenizer: Tokenizer) -> None:
    """The parity prompt really exercises byte-fallback: some single tokens decode to partial characters."""
    ids = tokenizer.encode(PROMPT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_tiny_matches_transformers(tiny: LoadedModel) -> None:
    """Each tiny architecture (Llama tied, Qwen2 QKV bias untied, Qwen3 q/k norm) equals transformers."""
    ids = prompt_ids(tiny)
    ref = reference_logits(hf_model_for(tiny), ids)
    ours = full_prefill(tiny, ids)
    assert ref.std().item() > 0.05  # not a degenerate model: there is something to get wrong
    assert_logits_close(ours, ref)


@pytest.mark.embedded
def test_embedded_matches_transformers(embedded: LoadedModel, embedded_hf: PreTrainedModel) -> None:
    """The real SmolLM2 checkpoint gives the same logits as transformers loading the same folder."""
    ids = prompt_ids(embedded)
    ref = reference_logits(embedded_hf, ids)
    ours = full_prefill(embedded, ids)
    assert ref.abs().max().item() > 10  # trained logits, not noise
    assert_logits_close(ours, ref)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_tiny_decode_token_by_token_equals_prefill(tiny: LoadedModel) -> None:
    """Prefill a prefix, then decode one token per forward against the cache: same logits as one prefill."""
    ids = prompt_ids(tiny)
    full = full_prefill(tiny, ids)
    stepped = forward_chunks(tiny, ids, [8] + [1] * (len(ids) - 8))
    assert_logits_close(stepped, full)


def test_tiny_prefix_cached_chunk_equals_prefill(tiny: LoadedModel) -> None:
    """Chunks of several new tokens after a cached prefix (start > 0) see exactly the right keys."""
    ids = prompt_ids(tiny)
    full = full_prefill(tiny, ids)
    rest = len(ids) - 10 - 17
    chunked = forward_chunks(tiny, ids, [10, 17, rest])
    assert_logits_close(chunked, full)


@pytest.mark.embedded
def test_embedded_decode_and_chunks_equal_prefill(embedded: LoadedModel) -> None:
    """On the real model: prefill, a prefix-cached chunk, then token-by-token decode all match one prefill."""
    ids = prompt_ids(embedded)
    full = full_prefill(embedded, ids)
    # Each one-token forward reads every weight (~0.5 GB in float32), so decode only the last dozen tokens.
    decoded = 12
    chunked = forward_chunks(embedded, ids, [12, len(ids) - 12 - decoded] + [1] * decoded)
    assert_logits_close(chunked, full)
    assert torch.equal(chunked.argmax(-1), full.argmax(-1))


def test_cache_overflow_is_refused(tiny: LoadedModel) -> None:
    """A forward that would write past the reserved capacity raises instead of corrupting memory."""
    model = tiny.model
    cache = ContiguousKVCache(model.config, 4, model.device, model.dtype)
    with pytest.raises(ValueError, match="cache holds 4 tokens"):
        ContiguousForward(cache, 2, 3, model.device)
