"""Step 13: step 12's decode graphs with fewer, larger kernels: packed projections, fused element-wise
chains, our own skinny matrix multiply and programmatic dependent launch.

Examples:
    .venv/bin/python step13_fused_decode/run.py --dry-run                          # tiny models, parity with HF (eager, plain, on CPU)
    .venv/bin/python step13_fused_decode/run.py --device cuda --dry-run --attn triton --dtype float32
    .venv/bin/python step13_fused_decode/run.py --bench --device cuda --model random:qwen2.5-7b --batch-sizes 1,8,32,64
    .venv/bin/python step13_fused_decode/run.py --bench --device cuda --model random:qwen2.5-7b --no-skinny-matmul --no-pdl
"""

import argparse

from common.cli import main
from step12_cuda_graph.run import add_arguments as add_step12_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_step12_arguments(parser)
    fused = parser.add_argument_group("fused decode")
    fused.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=None,
                       help="decode with packed projections and one Triton kernel per element-wise chain "
                            "(default: on wherever decode is captured as graphs)")
    fused.add_argument("--skinny-matmul", action=argparse.BooleanOptionalAction, default=None,
                       help="with --fused-ops, run projections of at most 16 rows through our own matrix multiply "
                            "instead of cuBLAS (default: whenever fused ops are on)")
    fused.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                       help="with --fused-ops, launch their kernels and step 06's attention kernels with "
                            "programmatic dependent launch "
                            "(default: wherever decode is captured on a GPU of compute capability 9.0 or later)")


if __name__ == "__main__":
    raise SystemExit(main("step13_fused_decode", __doc__, add_arguments=add_arguments))
