"""Step 07: optimistic admission with preemption (swap or recompute) and per-request priorities.

Examples:
    .venv/bin/python step07_preemption/run.py --dry-run                          # tiny models, parity with HF
    .venv/bin/python step07_preemption/run.py --block-size 4 --num-blocks 24     # a budget far too small: preemptions
    .venv/bin/python step07_preemption/run.py --block-size 4 --num-blocks 24 --preempt swap
"""

import argparse

from common.cli import main
from step06_paged_attention.run import add_arguments as add_step06_arguments

# engine.py's PREEMPT_MODES, written out: importing the engine loads torch, which --help should not wait for
# (tests/test_cli_flags.py keeps the two equal).
PREEMPT_MODES = ("recompute", "swap")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_step06_arguments(parser)
    preemption = parser.add_argument_group("preemption")
    preemption.add_argument("--preempt", choices=PREEMPT_MODES, default="recompute",
                            help="what to do with a preempted request's KV cache (default: recompute)")
    preemption.add_argument("--swap-per-block", action="store_true",
                            help="ablation: swap with one small copy per block and layer")


if __name__ == "__main__":
    raise SystemExit(main("step07_preemption", __doc__, add_arguments=add_arguments))
