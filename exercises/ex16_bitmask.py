"""Exercise 16-bitmask: a batch's grammar masks, from the matcher's packed words to one boolean per token.

Write the body of `allowed_tokens`; `python -m exercises run 16-bitmask` plugs it into step 16 in place of
`bitmask.allowed_tokens` and runs step 16's tests and dry run on it.
"""

from __future__ import annotations

import torch


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Which tokens each row's grammar allows next.

    Inputs: `bitmask`, [rows, words] int32, as the matcher fills it: 32 tokens to a word, in order, bit j of word w
    (counting from the least significant bit) set where token 32 w + j is allowed; `vocab_size`, the number of
    logits in a row (the words may cover a few more tokens than that: they are cut).
    Returns: [rows, vocab_size] bool, on the bitmask's device, with no loop over rows or tokens in Python.
    Rule: token t is allowed where bit t % 32 of word t // 32 is set. Bit 31 is the sign bit of an int32: a word
    with it set is negative, and its other bits mean what they always do.

    Example: one row, the words [0b1011, -2**31] and vocab_size 64 allow tokens [0, 1, 3, 63]; with vocab_size 40,
    tokens [0, 1, 3].

    Hints (step16_structured_output/README.md, "The idea": the worked example's bits 7..0 column).
    """
    raise NotImplementedError("write bitmask.allowed_tokens: see the hints in its docstring")
