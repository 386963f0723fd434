"""Exercise 15-row-tiles: a linear layer whose every row gets the same bits in any batch, on a CPU.

Write the body of `row_tiled_linear`; `python -m exercises run 15-row-tiles` plugs it into step 15 in place of
`step15_batch_invariant.invariant_ops.row_tiled_linear` and runs step 15's tests and its dry run
(`--batch-invariant`) on it: a request's logits must come out bit for bit the same alone and batched.
"""

from __future__ import annotations

import torch


def row_tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), each row of the result the same bits however many rows x has.

    Inputs: `x`, `[rows, in_features]`; `weight`, `[out_features, in_features]`; `bias`, `[out_features]` or None.
    Returns: `[rows, out_features]`, x @ weight.T + bias.
    Rule: row i of the result depends on row i of x alone, bit for bit. The library behind `torch.mm` picks its
    method by the shape it is handed (a matrix-vector kernel for one row, blocked kernels for more), and each
    method rounds differently: so never hand it a shape that depends on the batch. Multiply in tiles of exactly
    `ROW_TILE` rows (16, from `step15_batch_invariant.invariant_ops`), the last tile padded with rows of zeros,
    and keep the first `rows` rows. The bias is added after the multiply: an element-wise add is the same in any
    batch.

    Example: 40 rows are three multiplies of 16 rows (the third holding 8 rows and 8 rows of zeros); 1 row is
    one multiply of 16. Row 0 goes through the same 16-row multiply in both, so it comes out the same.

    Hints (step15_batch_invariant/README.md, "Fix 1: one shape for every multiply").
    """
    raise NotImplementedError("write step15_batch_invariant.invariant_ops.row_tiled_linear: see the hints")
