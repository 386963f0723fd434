"""Step 15: batch invariance. With --batch-invariant, every kernel computes a request's row the same way
whatever else is in the step, so its tokens and logits are the same alone and in any batch; without it,
step 14 as it is.

Examples:
    .venv/bin/python step15_batch_invariant/run.py --dry-run --batch-invariant    # tiny models, parity with HF (on CPU)
    .venv/bin/python step15_batch_invariant/bench/probe.py                         # which ops change with the batch here
    .venv/bin/python step15_batch_invariant/run.py --bench --device cuda --model random:qwen2.5-7b --batch-invariant
"""

import argparse

from common.cli import main
from step14_overlap_scheduling.run import add_arguments as add_step14_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_step14_arguments(parser)
    invariant = parser.add_argument_group("batch invariance")
    invariant.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                           help="compute every request's row the same way whatever else is in the step: the same "
                                "tokens and logits alone and batched (costs speed; default: off)")


if __name__ == "__main__":
    raise SystemExit(main("step15_batch_invariant", __doc__, add_arguments=add_arguments))
