"""Exercise 17-quantize: a weight to e4m3 bytes and a scale per row.

Write the body of `quantize`; `python -m exercises run 17-quantize` plugs it into step 17 in place of
`fp8.quantize` and runs step 17's tests and dry run on it.
"""

from __future__ import annotations

import torch

from step17_fp8_weights.fp8 import E4M3, E4M3_MAX, Fp8Weight


def quantize(weight: torch.Tensor, per_row: bool = True) -> Fp8Weight:
    """A weight as e4m3 values and a float32 scale per row (or one scale for the whole tensor).

    Inputs: `weight`, [out, in] in any float dtype; `per_row`, whether each row gets its own scale.
    Returns: `Fp8Weight(values, scale)`: `values` [out, in] of dtype `E4M3` (torch.float8_e4m3fn), `scale` float32,
    [out] per row or [1] for the tensor, such that values * scale (row by row) is the weight as closely as e4m3 holds it.
    Rule: a row's scale is its largest magnitude over `E4M3_MAX` (448), so that magnitude lands on 448; each weight
    divided by its scale is rounded to the nearest e4m3 value (casting to `E4M3` rounds). An all-zero row still needs a
    scale above 0.

    Example: the row [4.48, -1.0, 0.5, 0.0] has scale 0.01, values [448, -96, 48, 0] (100 rounds to 96).

    Hints (step17_fp8_weights/README.md, "The idea": the worked row).
    """
    raise NotImplementedError("write fp8.quantize: see the hints in its docstring")
