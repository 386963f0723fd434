"""Step 06: paged attention (no gather, no copy) and one batched prefill for all admitted requests.

Examples:
    .venv/bin/python step06_paged_attention/run.py --dry-run                     # torch backend on CPU, parity with HF
    TRITON_INTERPRET=1 .venv/bin/python step06_paged_attention/run.py --dry-run --attn triton   # our kernels, on a CPU
    .venv/bin/python step06_paged_attention/run.py                               # embedded model, checked against HF
    .venv/bin/python step06_paged_attention/run.py --bench --device cuda --model random:qwen2.5-7b --attn triton
    .venv/bin/python step06_paged_attention/run.py --kernel-bench                # kernels checked, then timed (CUDA)
"""

import argparse
import sys

from common.cli import main
from step02_paged_kv.run import add_arguments as add_step02_arguments

# backends.py's ATTENTION_BACKENDS, written out: importing backends.py loads torch, which --help should not wait
# for (tests/test_cli_flags.py keeps the two equal).
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_step02_arguments(parser)
    attention = parser.add_argument_group("paged attention")
    attention.add_argument("--attn", choices=ATTENTION_BACKENDS, default="auto",
                           help="auto: flash_attn if importable on CUDA, else triton on CUDA, else torch")
    attention.add_argument("--batched-prefill", action=argparse.BooleanOptionalAction, default=True,
                           help="prefill every admitted prompt in one forward (default); --no-batched-prefill: "
                                "one forward each, as step 03, to measure paged attention alone")
    attention.add_argument("--sync-per-layer", action="store_true",
                           help="ablation: read the longest length back with .item() in every layer")


if __name__ == "__main__":
    if "--kernel-bench" in sys.argv:  # a mode of its own, with its own options (see bench/kernel_bench.py)
        from step06_paged_attention.bench.kernel_bench import main as kernel_bench

        raise SystemExit(kernel_bench([a for a in sys.argv[1:] if a != "--kernel-bench"]))
    raise SystemExit(main("step06_paged_attention", __doc__, add_arguments=add_arguments))
