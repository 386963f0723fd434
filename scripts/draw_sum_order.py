"""Draw step 15's picture: one row summed in pieces that follow the batch, against pieces of a fixed size.

    .venv/bin/python scripts/draw_sum_order.py            # prints the text drawing of step15_batch_invariant/README.md

The row is eight bfloat16 numbers. Every addition is one torch operation on bfloat16 tensors, so each partial
sum is rounded to bfloat16 as it is stored, the way a kernel rounds what it keeps in a narrow type. Near 256 a
bfloat16 number has a step of 2, so 256 + 1 rounds back to 256 (a tie, to the even neighbour): where the ones
are added decides whether they count. The numbers are small so that the rounding shows; in float32 the same
thing happens in the last bits of a real row.
"""

from __future__ import annotations

import torch

ROW = [256.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
DTYPE = torch.bfloat16
PIECE = 4  # step 15's fixed piece (1,024 keys in its attention; 4 numbers here)


def in_order(values: list[torch.Tensor]) -> torch.Tensor:
    """Add the values from the first, rounding each partial sum to the row's dtype."""
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


def summed_in_pieces(row: torch.Tensor, pieces: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Cut the row into `pieces` equal parts, sum each in order, then merge the parts' sums in order."""
    parts = [in_order(list(part)) for part in row.chunk(pieces)]
    return parts, in_order(parts)


def bits(value: torch.Tensor) -> str:
    return f"0x{int(value.view(torch.int16)) & 0xFFFF:04x}"


def show(value: torch.Tensor) -> str:
    return f"{float(value):g} ({bits(value)})"


def drawing() -> str:
    row = torch.tensor(ROW, dtype=DTYPE)
    cells = " ".join(f"{v:g}" for v in ROW)
    lines = [f"one row, bfloat16: [{cells}]   exact sum {sum(ROW):g}", ""]

    lines.append("steps 06-14: the number of splits follows the batch")
    for label, pieces in (("batch 1, 4 splits ", 4), ("batch 64, 1 split ", 1)):
        parts, total = summed_in_pieces(row, pieces)
        sums = " + ".join(f"{float(p):g}" for p in parts) if pieces > 1 else "256 + 1 + 1 + ... in order"
        lines.append(f"  {label} {_pieces(pieces)}  ->  {sums:<26} = {show(total)}")
    lines.append("")
    lines.append(f"step 15: pieces of {PIECE} numbers whatever the batch, their sums merged in order")
    for label, workers in (("batch 1, 2 workers", 2), ("batch 64, 1 worker", 1)):
        parts, total = with_workers(row, PIECE, workers)
        sums = " + ".join(f"{float(p):g}" for p in parts)
        lines.append(f"  {label} {_pieces(len(ROW) // PIECE)}  ->  {sums:<26} = {show(total)}")
    return "\n".join(lines)


def with_workers(row: torch.Tensor, piece: int, workers: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Step 15's order: pieces of a fixed size; worker w sums pieces w, w + workers, ...; the pieces' sums are
    then merged in piece order, whoever computed them."""
    pieces = list(row.split(piece))
    done: dict[int, torch.Tensor] = {}
    for worker in range(workers):
        for index in range(worker, len(pieces), workers):
            done[index] = in_order(list(pieces[index]))
    parts = [done[index] for index in range(len(pieces))]
    return parts, in_order(parts)


def _pieces(pieces: int) -> str:
    size = len(ROW) // pieces
    return " ".join("[" + " ".join(f"{v:g}" for v in ROW[i:i + size]) + "]" for i in range(0, len(ROW), size)).ljust(33)


if __name__ == "__main__":
    print(drawing())
