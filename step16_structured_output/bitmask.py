"""A batch's grammar masks applied to its logits on the device, for every constrained row at once.

`allowed_tokens` and `apply_token_bitmask` say it in PyTorch: unpack each word's 32 bits, then fill the forbidden
logits. On a GPU that is a handful of whole-vocabulary ops (64 rows of 152,064 float32 logits are 39 MB each time),
so there `masked_logits_kernel` does the same in one pass: each program reads a block of one row's logits and the
words that cover it, and writes the block masked (or as it was, for a row without a grammar).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BITS = 32  # tokens per word of a bitmask
BLOCK = 2048  # tokens per program of the kernel


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool: bit j of word w allows token 32 w + j."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # the shift copies the sign bit down, & 1 keeps bit j alone
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The logits with every token the grammar forbids at -inf, in the `rows` that have a grammar (row i of the
    bitmask is for logits row rows[i]; the others as they are). A new tensor: the logits may be a captured graph's
    output buffer."""
    if logits.is_cuda:
        return masked_logits(logits, bitmask, rows)
    masked = logits[rows].masked_fill(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))
    return logits.index_put((rows,), masked)


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`apply_token_bitmask` as one Triton kernel over every row of the logits (on a CPU in Triton's interpreter)."""
    assert logits.stride(-1) == 1 and bitmask.is_contiguous()
    num_rows, vocab_size = logits.shape
    # Which bitmask row each logits row takes (-1: no grammar), so that one launch covers the batch.
    mask_row = torch.full((num_rows,), -1, dtype=torch.int32, device=logits.device)
    mask_row[rows] = torch.arange(len(rows), dtype=torch.int32, device=logits.device)
    out = torch.empty_like(logits)
    grid = (num_rows, triton.cdiv(vocab_size, BLOCK))
    masked_logits_kernel[grid](logits, out, bitmask, mask_row, logits.stride(0), out.stride(0), bitmask.shape[1],
                               vocab_size, BLOCK=BLOCK)
    return out


@triton.jit
def masked_logits_kernel(LOGITS, OUT, BITMASK, MASK_ROW, stride_logits, stride_out, words, vocab_size,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab_size
    values = tl.load(LOGITS + row * stride_logits + tokens, mask=inside)
    mask_row = tl.load(MASK_ROW + row + tl.zeros_like(tokens))  # the row's bitmask row, once per token
    # A row without a grammar reads no word: every bit set (-1) allows every token.
    word = tl.load(BITMASK + mask_row * words + tokens // 32, mask=inside & (mask_row >= 0), other=-1)
    allowed = ((word >> (tokens % 32)) & 1) != 0
    tl.store(OUT + row * stride_out + tokens, tl.where(allowed, values, float("-inf")), mask=inside)
