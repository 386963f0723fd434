"""A batch's grammar masks applied to its logits on the device, in one set of ops for every constrained row."""

from __future__ import annotations

import torch

BITS = 32  # tokens per word of a bitmask


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool: bit j of word w allows token 32 w + j."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # the shift copies the sign bit down, & 1 keeps bit j alone
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The logits with every token the grammar forbids at -inf, in the `rows` that have a grammar (the others as
    they are). A new tensor: the logits may be a captured graph's output buffer."""
    masked = logits[rows].masked_fill(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))
    return logits.index_put((rows,), masked)
