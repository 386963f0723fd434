"""Step 10: full KV blocks keyed by their tokens and shared by requests that start alike.

Examples:
    .venv/bin/python step10_prefix_caching/run.py --dry-run                          # tiny models, parity with HF
    .venv/bin/python step10_prefix_caching/run.py --no-enable-prefix-caching         # step 09's behaviour
    .venv/bin/python step10_prefix_caching/bench/bench_prefix.py                     # shared prefixes and multi-turn chat
"""

import argparse

from common.cli import main
from step09_chunked_prefill.run import add_arguments as add_step09_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_step09_arguments(parser)
    caching = parser.add_argument_group("prefix caching")
    caching.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                         help="reuse the KV blocks of prompts that start alike (default: on)")


if __name__ == "__main__":
    raise SystemExit(main("step10_prefix_caching", __doc__, add_arguments=add_arguments))
