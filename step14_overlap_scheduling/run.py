"""Step 14: overlap scheduling. Each decode step is launched before the host processes the previous one's
tokens, so the host's work is hidden behind the GPU's; graphs, fused kernels and scheduling are step 13's.

Examples:
    .venv/bin/python step14_overlap_scheduling/run.py --dry-run                 # tiny models, parity with HF (eager, on CPU)
    .venv/bin/python step14_overlap_scheduling/run.py --dry-run --overlap       # the launch-ahead path itself, eagerly
    .venv/bin/python step14_overlap_scheduling/run.py --bench --device cuda --model random:qwen2.5-7b --batch-sizes 1,8,64
    .venv/bin/python step14_overlap_scheduling/run.py --bench --device cuda --model random:qwen2.5-7b --no-overlap
"""

import argparse

from common.cli import main
from step13_fused_decode.run import add_arguments as add_step13_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_step13_arguments(parser)
    overlap = parser.add_argument_group("overlap scheduling")
    overlap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                         help="launch each decode step before the host has processed the previous one's tokens "
                              "(default: on wherever decode is captured as graphs; --overlap on a CPU runs the "
                              "same path eagerly)")


if __name__ == "__main__":
    raise SystemExit(main("step14_overlap_scheduling", __doc__, add_arguments=add_arguments))
