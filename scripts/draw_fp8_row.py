"""Step 17's worked example: one row of weights to e4m3 and back, with each value's bits.

The row's largest magnitude sets its scale (it lands on 448, e4m3's largest value); each weight divided by the scale
rounds to the nearest e4m3 value, whose byte is printed as sign | exponent | mantissa; the value times the scale is
what the multiply reads. Computed by step17_fp8_weights/fp8.py and PyTorch's float8_e4m3fn, not typed.

    .venv/bin/python scripts/draw_fp8_row.py
"""

from __future__ import annotations

import torch

from step17_fp8_weights.fp8 import quantize

ROW = [0.91, -0.42, 0.0731, 0.2, -0.0044, 0.0]


def bits(value: torch.Tensor) -> str:
    """An e4m3 byte as sign | 4 exponent bits | 3 mantissa bits."""
    byte = int(value.view(torch.uint8))
    text = f"{byte:08b}"
    return f"{text[0]} {text[1:5]} {text[5:]}"


def main() -> None:
    q = quantize(torch.tensor([ROW]))
    scale = q.scale.item()
    print(f"row {ROW}; largest magnitude {max(map(abs, ROW))}, scale {max(map(abs, ROW))} / 448 = {scale:.6f}")
    print(f"{'weight':>9} {'/ scale':>9} {'e4m3 byte':>11} {'e4m3 value':>10} {'x scale':>9} {'error':>7}")
    back = q.dequantize()[0]
    for weight, value, restored in zip(ROW, q.values[0], back, strict=True):
        divided = weight / scale
        error = f"{abs(restored.item() - weight) / abs(weight):.1%}" if weight else "-"
        print(f"{weight:>9} {divided:>9.2f} {bits(value):>11} {value.float().item():>10g} {restored.item():>9.5f} "
              f"{error:>7}")


if __name__ == "__main__":
    main()
