"""Step 12: decode steps replayed as CUDA graphs per batch bucket, mixed steps per token bucket; the token
budget, prefix caching, speculation (off unless asked for), scheduling and preemption are steps 09 to 11's.

Examples:
    .venv/bin/python step12_cuda_graph/run.py --dry-run                          # tiny models, parity with HF (eager on CPU)
    .venv/bin/python step12_cuda_graph/run.py --device cuda --dry-run --attn triton --dtype float32
    .venv/bin/python step12_cuda_graph/run.py --bench --device cuda --model random:qwen2.5-7b --batch-sizes 1,8,32,64
    .venv/bin/python step12_cuda_graph/run.py --bench --device cuda --model random:qwen2.5-7b --no-cuda-graph
"""

import argparse

from common.cli import at_least, main
from step11_speculative_decoding.run import add_arguments as add_step11_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_step11_arguments(parser, speculative_tokens=0)  # speculation: --speculative-tokens 4
    graphs = parser.add_argument_group("CUDA graphs")
    graphs.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                        help="replay decode steps as CUDA graphs (default; on CPU the same path runs eagerly)")
    graphs.add_argument("--max-graph-batch", type=at_least(1), default=256,
                        help="the largest decode batch with a graph; larger batches run eagerly (default 256)")
    graphs.add_argument("--mixed-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="replay mixed steps (decoders and prefill chunks) as graphs per token bucket (default: "
                             "on wherever decode is captured; --mixed-graphs on a CPU runs the padded path eagerly)")


if __name__ == "__main__":
    raise SystemExit(main("step12_cuda_graph", __doc__, add_arguments=add_arguments))
