"""Attention backends: how one layer's attention reads and writes the paged KV cache.

Every backend gets the same `AttentionMetadata`, built once per forward by the engine, and one layer's K and
V pools (`[num_blocks, block_size, kv_heads, head_dim]`). Three implementations:

- `torch`: the reference, on any device. It still gathers (PyTorch has no paged attention), so it is the
  oracle for the others, not a speed-up.
- `triton`: our own kernels (`triton_kernels.py`): attention reads K/V through the block table in place.
- `flash_attn`: the flash-attn package's paged API, where it is installed (its block size must be a
  multiple of 256).

`--attn auto` picks flash_attn if importable on CUDA, else triton on CUDA, else torch.
"""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """One forward's view of the batch. Device tensors for the kernels, and the host-side figures as plain
    ints, computed once by the engine so that no layer ever has to ask the device for them."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [new tokens]: where each new token's K/V is stored
    block_table: torch.Tensor  # [batch, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [batch] int32: each sequence's length after this forward
    cu_q_lens: torch.Tensor  # [batch + 1] int32: offsets of each request's new tokens, laid end to end
    q_lens: list[int]  # new tokens per request (host)
    seq_lens_host: list[int]  # the same lengths as `seq_lens` (host)
    max_q_len: int
    max_seq_len: int
    block_size: int


class AttentionBackend(ABC):
    name: str
    # What the backend can do, declared so that a later step asks rather than checks which backend it is:
    # whether `decode` (or `prefill`) reads every length from device memory, sizing its launch from no host
    # figure but `num_splits`, so that a CUDA graph can record it once and replay it for any batch.
    capturable_decode: bool = False
    capturable_prefill: bool = False

    @classmethod
    def for_engine(cls, device: torch.device, block_size: int, max_batch: int) -> AttentionBackend:
        """The backend an engine runs on `device`, for its block size and its largest batch."""
        return cls()

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Store the new tokens' K/V at their slots: one scatter for the whole batch."""
        slots = meta.slot_mapping.long()  # index_copy_ takes int64 indices
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q: [batch, heads, head_dim], one new token per request. Returns the same shape."""

    def num_splits(self, batch: int, kv_heads: int, max_seq_len: int) -> int:
        """Into how many parts `decode` splits each sequence for this batch and longest length: the one host
        number it sizes its launch from (1: it does not split)."""
        return 1

    @abstractmethod
    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [new tokens, heads, head_dim], requests end to end, each attending causally to its cached
        prefix and itself. Returns the same shape."""


class TorchBackend(AttentionBackend):
    """The reference: gather each sequence out of the pool, then PyTorch's scaled_dot_product_attention.

    With `splits` > 1 its decode works as our Triton kernel does, in plain torch (split-K): each part of the
    keys gives a partial result, and `merge_splits` combines them. The default, 1, is the oracle; the split
    path is checked against it (tests/test_step06_paged_attention.py), and is the lesson's exercise."""

    name = "torch"

    def __init__(self, splits: int = 1) -> None:
        self.splits = splits

    def num_splits(self, batch: int, kv_heads: int, max_seq_len: int) -> int:
        return self.splits

    @staticmethod
    def gather(cache: torch.Tensor, meta: AttentionMetadata, width: int) -> torch.Tensor:
        """[batch, width, kv_heads, head_dim]: every sequence's first `width` slots, in order."""
        blocks = -(-width // meta.block_size)
        rows = cache[meta.block_table[:, :blocks].long()]  # [batch, blocks, block_size, kv_heads, head_dim]
        return rows.flatten(1, 2)[:, :width]

    def decode(self, q, k_cache, v_cache, meta):
        keys = self.gather(k_cache, meta, meta.max_seq_len)
        values = self.gather(v_cache, meta, meta.max_seq_len)
        key_pos = torch.arange(meta.max_seq_len, device=q.device)
        valid = key_pos[None, :] < meta.seq_lens[:, None]  # [batch, max_seq_len]
        splits = self.num_splits(q.shape[0], k_cache.shape[2], meta.max_seq_len)
        if splits > 1:
            return self.split_decode(q, keys, values, valid, splits)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=valid[:, None, None, :], enable_gqa=True)
        return out[:, :, 0, :]

    def split_decode(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                     splits: int) -> torch.Tensor:
        """Split-K decode in float32: the padded keys `[batch, max_len, kv_heads, head_dim]` cut into `splits`
        consecutive parts; each part's max `m`, sum `l` of exp(s - m) and `acc`, the sum of exp(s - m) * v, as
        the kernel's splits store them; then `merge_splits`. A part holding none of its request's keys (a short
        request, or the padding) gives m = -inf, l = 0, acc = 0."""
        batch, heads, head_dim = q.shape
        group = heads // keys.shape[2]
        width = -(-keys.shape[1] // splits)  # keys per part, padded so that every part has `width`
        pad = width * splits - keys.shape[1]
        keys = F.pad(keys.float(), (0, 0, 0, 0, 0, pad)).repeat_interleave(group, dim=2)  # [batch, keys, heads, d]
        values = F.pad(values.float(), (0, 0, 0, 0, 0, pad)).repeat_interleave(group, dim=2)
        scores = torch.einsum("bhd,bthd->bht", q.float(), keys) * head_dim**-0.5
        scores = scores.masked_fill(~F.pad(valid, (0, pad))[:, None, :], float("-inf"))
        scores = scores.view(batch, heads, splits, width)
        m = scores.amax(-1)  # [batch, heads, splits]
        p = torch.exp(scores - m.masked_fill(m == float("-inf"), 0.0)[..., None])  # an empty part: exp(-inf) = 0
        acc = torch.einsum("bhsw,bswhd->bhsd", p, values.view(batch, splits, width, heads, head_dim))
        return self.merge_splits(acc, m, p.sum(-1)).to(q.dtype)

    def merge_splits(self, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
        """The splits' partial results combined: acc `[batch, heads, splits, head_dim]`, m and l
        `[batch, heads, splits]` -> `[batch, heads, head_dim]`, what `merge_splits_kernel` computes."""
        m_max = m.amax(-1, keepdim=True)  # finite: every request's first part holds its first key
        weight = torch.exp(m - m_max)  # each part rescaled to the common max; 0 for an empty part
        return (acc * weight[..., None]).sum(-2) / (l * weight).sum(-1, keepdim=True)

    def prefill(self, q, k_cache, v_cache, meta):
        keys = self.gather(k_cache, meta, meta.max_seq_len)
        values = self.gather(v_cache, meta, meta.max_seq_len)
        out = torch.empty_like(q)
        start = 0
        for i, (n, length) in enumerate(zip(meta.q_lens, meta.seq_lens_host)):
            # The new tokens sit at positions length - n .. length - 1 and see every key up to their own.
            key_pos = torch.arange(length, device=q.device)
            query_pos = torch.arange(length - n, length, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            rows = slice(start, start + n)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), keys[i, :length].transpose(0, 1), values[i, :length].transpose(0, 1),
                attn_mask=mask, enable_gqa=True,
            ).transpose(0, 1)
            start += n
        return out


class TritonBackend(AttentionBackend):
    """Our kernels: no gather, no dense copy; K/V read through the block table inside the kernel."""

    name = "triton"
    capturable_decode = True

    @classmethod
    def for_engine(cls, device: torch.device, block_size: int, max_batch: int) -> TritonBackend:
        require_triton_device(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        return cls(sms, max_batch)

    def __init__(self, num_sms: int, max_batch: int = 256) -> None:
        from step06_paged_attention import triton_kernels

        self.kernels = triton_kernels.PagedAttentionKernels()
        self.paged_prefill = triton_kernels.paged_prefill
        self.num_sms = num_sms
        self.max_batch = max_batch  # the most requests one decode call will hold
        # Where the decode kernel's splits count in, one counter per (request, KV head). Every call leaves them
        # at zeros, so one buffer, made once for the largest batch, serves every call without being zeroed.
        self.arrived: torch.Tensor | None = None

    def num_splits(self, batch: int, kv_heads: int, max_seq_len: int) -> int:
        """Split long sequences when batch x KV heads alone would leave most of the GPU idle. Fill one wave
        of about four programs per multiprocessor, never more: the H200 sweep (kernel_bench.py) showed a
        grid just past one wave losing up to a fifth of the bandwidth to its straggling second wave. Each
        split gets at least one 64-token tile, and at least two once there are a quarter as many rows as
        multiprocessors: a one-tile split then costs more to merge than it saves (same sweep, 7a98687: 16, 32
        and 64 x 128 took 3% to 12% less time unsplit than in two splits, 8 x 128 3% less split)."""
        rows = batch * kv_heads
        one_wave = 4 * self.num_sms // rows
        tokens_per_split = 128 if 4 * rows >= self.num_sms else 64
        return max(1, min(one_wave, max_seq_len // tokens_per_split, 32))

    def write_kv(self, k_cache, v_cache, k, v, meta):
        self.kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def decode(self, q, k_cache, v_cache, meta):
        batch, kv_heads = q.shape[0], k_cache.shape[2]
        splits = self.num_splits(batch, kv_heads, meta.max_seq_len)
        if self.arrived is None or self.arrived.numel() < batch * kv_heads:
            rows = max(batch, self.max_batch) * kv_heads
            self.arrived = torch.zeros(rows, dtype=torch.int32, device=q.device)
        return self.kernels.paged_decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, num_splits=splits,
                                         arrived=self.arrived)

    def prefill(self, q, k_cache, v_cache, meta):
        return self.paged_prefill(q, k_cache, v_cache, meta.block_table, meta.cu_q_lens, meta.seq_lens,
                                  meta.max_q_len)


class FlashAttnBackend(AttentionBackend):
    """flash-attn's paged kernels (`flash_attn_with_kvcache`, `flash_attn_varlen_func` with a block table)."""

    name = "flash_attn"
    capturable_decode = True

    @classmethod
    def for_engine(cls, device: torch.device, block_size: int, max_batch: int) -> FlashAttnBackend:
        return cls(block_size)

    def __init__(self, block_size: int) -> None:
        if block_size % 256:
            raise ValueError(f"flash-attn's paged KV cache needs a block size that is a multiple of 256, "
                             f"got {block_size}: pass --block-size 256")
        import flash_attn

        self.fa = flash_attn

    def decode(self, q, k_cache, v_cache, meta):
        out = self.fa.flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                              block_table=meta.block_table, causal=True)
        return out[:, 0]

    def prefill(self, q, k_cache, v_cache, meta):
        cu_k = torch.zeros(len(meta.seq_lens_host) + 1, dtype=torch.int32, device=q.device)
        cu_k[1:] = meta.seq_lens.cumsum(0)
        return self.fa.flash_attn_varlen_func(q, k_cache, v_cache, meta.cu_q_lens, cu_k, meta.max_q_len,
                                              meta.max_seq_len, causal=True, block_table=meta.block_table)


BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchBackend, "triton": TritonBackend,
                                               "flash_attn": FlashAttnBackend}
ATTENTION_BACKENDS = ("auto", *BACKENDS)


def require_triton_device(device: torch.device) -> None:
    """Triton compiles for GPUs; on a CPU only its interpreter runs kernels, and only when asked for."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("Triton kernels on a CPU run only in Triton's interpreter: set TRITON_INTERPRET=1 "
                         "(slow, for checking), or use a CUDA device")


def create_backend(name: str, device: torch.device, block_size: int, max_batch: int = 256,
                   classes: dict[str, type[AttentionBackend]] = BACKENDS) -> AttentionBackend:
    """The backend `name` (or the one `auto` picks), made from `classes`: a later step passes its own
    subclasses there."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(ATTENTION_BACKENDS)}")
    on_cuda = device.type == "cuda"
    if name == "auto":
        if on_cuda and importlib.util.find_spec("flash_attn") is not None and block_size % 256 == 0:
            name = "flash_attn"
        elif on_cuda and importlib.util.find_spec("triton") is not None:
            name = "triton"
        else:
            name = "torch"
    if name == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError("--attn triton needs the triton package (Linux x86-64): pip install triton")
    if name == "flash_attn" and (not on_cuda or importlib.util.find_spec("flash_attn") is None):
        raise ValueError("--attn flash_attn needs a CUDA device and the flash-attn package (pip install flash-attn)")
    return classes[name].for_engine(device, block_size, max_batch)
