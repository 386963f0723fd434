"""Time a decode step's projections at small batch sizes: cuBLAS (F.linear) against `skinny_linear`.

For each weight shape of one model (q/k/v packed, o, gate/up packed, down, the output head) and each number
of rows, the skinny kernel's output is first compared with F.linear's; then both are timed, the skinny
kernel at every launch setting of a small grid. Each call reads a different copy of the weight (enough
copies to exceed the L2 cache several times over), as 28 layers do, so a weight is never served from cache.
Timing replays a CUDA graph of many calls (`common.timing.timed_ms`). Achieved bandwidth counts the weight's
bytes. Writes JSON evidence with every setting's time, the best one per point, and cuBLAS's (by default
runs/step13_fused_decode/matmul-bench-cuda-<config>.json, ignored by git).

    .venv/bin/python step13_fused_decode/bench/matmul_bench.py --config qwen2.5-7b --rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_sizes
from common.config import ModelConfig, load_bundled_config
from common.timing import copy_bandwidth_gbs, timed_ms
from step13_fused_decode.skinny_matmul import SkinnyConfig, skinny_linear

L2_MULTIPLE = 8  # the copies of a weight together hold this many times the L2 cache (H200: 50 MB)
GRID = [SkinnyConfig(n, k, w, s) for n, k, w, s in
        itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 5))]


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int, bool]]:
    """Each projection a decode step runs: (output features, input features, has a bias)."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return {"qkv": (q + 2 * kv, h, config.qkv_bias), "o": (h, q, False),
            "gate_up": (2 * config.intermediate_size, h, False), "down": (h, config.intermediate_size, False),
            "lm_head": (config.vocab_size, h, False)}


def bench_shape(n: int, k: int, has_bias: bool, rows_tried: list[int], grid: list[SkinnyConfig],
                dtype: torch.dtype, repeats: int) -> list[dict]:
    device = torch.device("cuda")
    weight_bytes = n * k * dtype.itemsize
    copies = max(2, -(-L2_MULTIPLE * 50 * 2**20 // weight_bytes))
    weights = [torch.randn(n, k, dtype=dtype, device=device) * k**-0.5 for _ in range(copies)]
    bias = torch.randn(n, dtype=dtype, device=device) if has_bias else None
    points = []
    for rows in rows_tried:
        x = torch.randn(rows, k, dtype=dtype, device=device)
        expected = F.linear(x, weights[0], bias).float()
        turn = itertools.count()

        def cublas() -> None:
            F.linear(x, weights[next(turn) % copies], bias)

        cublas_ms = timed_ms(cublas, repeats)
        settings = []
        for config in grid:
            try:
                got = skinny_linear(x, weights[0], bias, config).float()
            except triton.runtime.errors.OutOfResources:  # the pipeline's buffers exceed shared memory
                settings.append({"config": vars(config), "error": None, "ms": None, "fits": False})
                continue
            error = (got - expected).abs().max().item() / expected.abs().max().item()
            if error > 2e-2:
                settings.append({"config": vars(config), "error": error, "ms": None})
                print(f"  {n}x{k} rows {rows} {config}: WRONG (relative error {error:.3g}), not timed")
                continue
            ms = timed_ms(lambda: skinny_linear(x, weights[next(turn) % copies], bias, config), repeats)
            settings.append({"config": vars(config), "error": error, "ms": ms})
        timed = [s for s in settings if s["ms"] is not None]
        best = min(timed, key=lambda s: s["ms"]) if timed else None
        point = {"n": n, "k": k, "bias": has_bias, "rows": rows, "weight_mb": weight_bytes / 1e6,
                 "copies": copies, "cublas_us": cublas_ms * 1e3,
                 "cublas_gbs": weight_bytes / (cublas_ms * 1e-3) / 1e9,
                 "best": best and {"config": best["config"], "us": best["ms"] * 1e3,
                                   "gbs": weight_bytes / (best["ms"] * 1e-3) / 1e9},
                 "settings": settings}
        points.append(point)
        verdict = (f"skinny best {point['best']['us']:.1f} us ({point['best']['gbs']:.0f} GB/s) "
                   f"{point['best']['config']}" if best else "skinny: no correct setting")
        print(f"{n}x{k} rows {rows}: cuBLAS {point['cublas_us']:.1f} us ({point['cublas_gbs']:.0f} GB/s); {verdict}",
              flush=True)
    return points


def shape_bench_parser(description: str, rows: str, output: str) -> Parser:
    """The arguments of a benchmark of a model's projection shapes; the caller adds its own."""
    p = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-7b", help="a bundled model config: the shapes to time")
    p.add_argument("--rows", default=rows)
    p.add_argument("--repeats", type=at_least(1), default=10)
    p.add_argument("--output", type=Path, default=None, help=f"evidence file (default {output})")
    return p


def parse_gpu_bench_args(p: Parser) -> tuple[argparse.Namespace, list[int]] | int:
    """The command line of a benchmark of projection shapes: (args, the row counts of --rows), or the exit code where
    a value is bad (one line, before any GPU work) or there is no GPU."""
    args = p.parse_args()
    try:
        check_args(args)
        rows_tried = parse_sizes("--rows", args.rows)
    except CommandLineError as err:
        return fail(err)
    if not torch.cuda.is_available():
        print("error: this times CUDA kernels: run it on a GPU machine", file=sys.stderr)
        return 2
    return args, rows_tried


def main() -> int:
    p = shape_bench_parser(__doc__, "1,2,4,8,16", "runs/step13_fused_decode/matmul-bench-cuda-<config>.json")
    parsed = parse_gpu_bench_args(p)
    if isinstance(parsed, int):
        return parsed
    args, rows_tried = parsed
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = load_bundled_config(args.config)
    header = evidence_header(device, f"shapes of {args.config}", dtype, rows=rows_tried,
                             copy_bandwidth_gbs=copy_bandwidth_gbs(device), grid_size=len(GRID))
    shapes = {}
    for name, (n, k, has_bias) in projection_shapes(config).items():
        shapes[name] = bench_shape(n, k, has_bias, rows_tried, GRID, dtype, args.repeats)
    write_json(args.output or default_output("step13_fused_decode", "matmul-bench-cuda", args.config),
               header | {"shapes": shapes})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
