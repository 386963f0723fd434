"""Step 17: FP8 weights. With --quantization fp8, each layer's projections are kept in e4m3 with a scale per row,
quantized as the engine starts from whatever checkpoint was loaded; without it, step 16 as it is.

Examples:
    .venv/bin/python step17_fp8_weights/run.py --quantization fp8   # the embedded model, checked against HF
    .venv/bin/python step17_fp8_weights/run.py --dry-run --quantization fp8   # tiny models of each architecture
"""

import argparse

from common.cli import main
from step15_batch_invariant.run import add_arguments as add_step15_arguments

QUANTIZATIONS = ("fp8",)  # the engine's own list, here without importing torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_step15_arguments(parser)
    weights = parser.add_argument_group("FP8 weights")
    weights.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                         help="fp8: each layer's projections in e4m3 with a scale per row, half the bytes of bf16 "
                              "(default: the weights as loaded)")


if __name__ == "__main__":
    raise SystemExit(main("step17_fp8_weights", __doc__, add_arguments=add_arguments))
