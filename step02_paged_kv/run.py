"""Step 02: paged KV cache, one batched decode forward per step, continuous batching (Python-loop gather).

Examples:
    .venv/bin/python step02_paged_kv/run.py --dry-run
    .venv/bin/python step02_paged_kv/run.py                          # embedded model, checked against HF generate()
    .venv/bin/python step02_paged_kv/run.py --block-size 4 --num-blocks 64
    .venv/bin/python step02_paged_kv/run.py --bench --batch-sizes 1,4,8
"""

import argparse

from common.cli import at_least, main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    paged = parser.add_argument_group("paged KV cache")
    paged.add_argument("--block-size", type=at_least(1), default=16, help="token slots per KV block (default 16)")
    paged.add_argument("--num-blocks", type=at_least(1), default=None,
                       help="KV budget in blocks (default: from memory)")
    paged.add_argument("--kv-memory-gb", type=float, default=None,
                       help="KV budget in GB when --num-blocks is not given (default: 90%% of free GPU memory, 1 GB on CPU)")


if __name__ == "__main__":
    raise SystemExit(main("step02_paged_kv", __doc__, add_arguments=add_arguments))
