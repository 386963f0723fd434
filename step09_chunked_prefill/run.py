"""Step 09: a token budget per step; long prompts prefilled in chunks, in one forward with the decoders.

Examples:
    .venv/bin/python step09_chunked_prefill/run.py --dry-run                                # tiny models, parity with HF
    .venv/bin/python step09_chunked_prefill/run.py --max-num-batched-tokens 16             # chunks of the demo prompts
    .venv/bin/python step09_chunked_prefill/run.py --max-num-batched-tokens 16 --block-size 4 --num-blocks 40
    .venv/bin/python step09_chunked_prefill/bench/bench_long_prompt.py                     # decoders vs one long prompt
"""

import argparse

from common.cli import at_least, main, refuse_flag
from step07_preemption.run import add_arguments as add_step07_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_step07_arguments(parser)
    # Step 06's and 07's way of prefilling (each admitted prompt whole, in one forward) no longer runs.
    refuse_flag(parser, "--batched-prefill", "--no-batched-prefill",
                why="prompts are prefilled in chunks under the token budget (--max-num-batched-tokens)")
    chunked = parser.add_argument_group("chunked prefill")
    # The defaults are engine.py's CPU_TOKEN_BUDGET and GPU_STEP_FLOPS, written out: importing the engine loads
    # torch, which --help should not wait for (tests/test_cli_flags.py keeps them equal).
    chunked.add_argument("--max-num-batched-tokens", type=at_least(1), default=None,
                         help="tokens one step may compute: every decoder's, then prefill chunks (default: "
                              "512 on a CPU; on a GPU about 8 TFLOP of the model's layers, 512 tokens of a 7B model)")


if __name__ == "__main__":
    raise SystemExit(main("step09_chunked_prefill", __doc__, add_arguments=add_arguments))
