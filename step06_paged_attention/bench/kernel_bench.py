"""Check, then time, the paged decode kernel over a sweep of batch sizes and context lengths.

For every point: random bf16 (or fp32) K/V in a pool with shuffled block tables; the kernel's output is
first compared with the float32 torch reference for every number of sequence splits tried (a point that
fails is reported and not timed); then the kernel at each split count, and torch SDPA on the same K/V laid
out densely, are timed. Timing replays a CUDA graph of `CALLS_PER_GRAPH` calls, so the figure is the
GPU's time per call, not the host's time to launch it (measured per call, a small kernel on a slow host
shows only the launch). Achieved bandwidth counts the K/V bytes one call must read. The device's copy
bandwidth is measured in the same run, as the ceiling. Writes JSON evidence (by default
runs/step06_paged_attention/kernel-bench-cuda.json, ignored by git).

    .venv/bin/python step06_paged_attention/run.py --kernel-bench                    # on a CUDA machine
    .venv/bin/python step06_paged_attention/bench/kernel_bench.py --batches 1,8 --contexts 128,2048 --output out.json
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_sizes
from common.config import load_bundled_config
from common.timing import CALLS_PER_GRAPH, copy_bandwidth_gbs, timed_ms
from step06_paged_attention import triton_kernels
from step06_paged_attention.backends import TritonBackend


SPLITS_TRIED = (1, 2, 4, 8, 16, 32)


def bench_point(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, device: torch.device, chosen_splits: int, repeats: int,
                other_tiles: Sequence[int] = (), launch_configs: Sequence[tuple[int, int]] = ()) -> dict:
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    order = list(range(num_blocks))
    random.Random(batch * 7919 + context).shuffle(order)
    table = torch.tensor(order, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)

    dense_k = k_cache[table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()  # [b, kvh, ctx, d]
    dense_v = v_cache[table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    reference = F.scaled_dot_product_attention(q.float()[:, :, None], dense_k.float(), dense_v.float(),
                                               enable_gqa=True)[:, :, 0]
    splits_tried = sorted({s for s in SPLITS_TRIED if s <= max(1, context // 64)} | {chosen_splits})

    default_launch = (triton_kernels.DECODE_WARPS, triton_kernels.DECODE_STAGES)
    arrived = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)  # kept, as the backend keeps it

    def decode(splits: int, tile: int = triton_kernels.DECODE_TILE, launch: tuple[int, int] = default_launch
               ) -> torch.Tensor:
        return triton_kernels.paged_decode(q, k_cache, v_cache, table, lens, num_splits=splits, tile=tile,
                                           num_warps=launch[0], num_stages=launch[1], arrived=arrived)

    error = max((decode(s, t, c).float() - reference).abs().max().item()
                for s in splits_tried for t in (triton_kernels.DECODE_TILE, *other_tiles)
                for c in (default_launch, *launch_configs))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    row = {"batch": batch, "context": context, "splits": chosen_splits, "max_abs_error": error,
           "correct": error <= tolerance}
    if not row["correct"]:
        return row
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    ms_by_splits = {s: timed_ms(lambda: decode(s), repeats) for s in splits_tried}
    kernel_ms = ms_by_splits[chosen_splits]
    best_splits = min(ms_by_splits, key=ms_by_splits.get)
    # Other tile sizes (tokens loaded per loop iteration), each at the best split count found above.
    ms_by_tile = {triton_kernels.DECODE_TILE: ms_by_splits[best_splits]}
    ms_by_tile |= {t: timed_ms(lambda: decode(best_splits, t), repeats) for t in other_tiles}
    # Other launch configurations (warps per program, software-pipelining stages), likewise.
    ms_by_launch = {f"{w}x{st}": timed_ms(lambda: decode(best_splits, launch=(w, st)), repeats)
                    for w, st in (default_launch, *launch_configs)}
    sdpa_ms = timed_ms(lambda: F.scaled_dot_product_attention(q[:, :, None], dense_k, dense_v, enable_gqa=True),
                       repeats)
    row |= {
        "kv_megabytes": kv_bytes / 1e6,
        "kernel_ms": kernel_ms, "kernel_gbs": kv_bytes / (kernel_ms * 1e-3) / 1e9,
        "sdpa_dense_ms": sdpa_ms, "sdpa_dense_gbs": kv_bytes / (sdpa_ms * 1e-3) / 1e9,
        "kernel_vs_sdpa": sdpa_ms / kernel_ms,
        "ms_by_splits": ms_by_splits, "best_splits": best_splits,
        "best_gbs": kv_bytes / (ms_by_splits[best_splits] * 1e-3) / 1e9,
        "ms_by_tile_at_best_splits": ms_by_tile,
        "ms_by_warps_x_stages_at_best_splits": ms_by_launch,
    }
    return row


def best_launch(row: dict) -> str:
    """The end of a point's printed line: the fastest launch configuration, when others were timed."""
    times = row["ms_by_warps_x_stages_at_best_splits"]
    if len(times) < 2:
        return ""
    fastest = min(times, key=times.get)
    return f", fastest launch {fastest} at {row['kv_megabytes'] / 1e3 / (times[fastest] * 1e-3):.0f} GB/s"


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-7b", help="the head layout to use (a bundled config name)")
    p.add_argument("--batches", default="1,8,16,32,64")
    p.add_argument("--contexts", default="128,512,2048,8192")
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--other-tiles", default="", help="also time these tile sizes (e.g. 32,128) at each point's "
                                                      "best split count")
    p.add_argument("--launch-configs", default="", help="also time these WARPSxSTAGES launch configurations "
                                                         "(e.g. 2x2,8x3) at each point's best split count")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--repeats", type=at_least(1), default=10,
                   help=f"graph replays ({CALLS_PER_GRAPH} calls each) per figure")
    p.add_argument("--output", type=Path,
                   help="evidence file (default runs/step06_paged_attention/kernel-bench-cuda.json, numbered if taken)")
    args, _ = p.parse_known_args(argv)
    try:  # before any GPU work: a bad value is one line and exit code 2
        check_args(args)
        batches = parse_sizes("--batches", args.batches)
        contexts = parse_sizes("--contexts", args.contexts)
        other_tiles = parse_sizes("--other-tiles", args.other_tiles) if args.other_tiles else []
    except CommandLineError as err:
        return fail(err)
    if not torch.cuda.is_available():
        print("error: the kernel benchmark times CUDA kernels: run it on a GPU machine", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    config = load_bundled_config(args.config)
    backend = TritonBackend(torch.cuda.get_device_properties(device).multi_processor_count)
    header = evidence_header(device, f"heads of {args.config}", dtype, block_size=args.block_size,
                             heads=config.num_heads, kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                             timing=f"CUDA graph of {CALLS_PER_GRAPH} calls, median of {args.repeats} replays")
    header["copy_bandwidth_gbs"] = copy_bandwidth_gbs(device)
    print(f"copy bandwidth: {header['copy_bandwidth_gbs']:.0f} GB/s")
    rows = []
    for batch in batches:
        for context in contexts:
            splits = backend.num_splits(batch, config.num_kv_heads, context)
            row = bench_point(batch, context, config.num_heads, config.num_kv_heads, config.head_dim,
                              args.block_size, dtype, device, splits, args.repeats,
                              other_tiles,
                              [tuple(map(int, c.split("x"))) for c in args.launch_configs.split(",") if c])
            if row["correct"]:
                row["kernel_vs_copy"] = row["kernel_gbs"] / header["copy_bandwidth_gbs"]
                print(f"batch {batch:3d} context {context:5d} splits {splits:2d}: {row['kernel_gbs']:7.0f} GB/s "
                      f"({100 * row['kernel_vs_copy']:.0f}% of copy), SDPA dense {row['sdpa_dense_gbs']:7.0f} GB/s, "
                      f"kernel {row['kernel_vs_sdpa']:.2f}x SDPA; best {row['best_splits']} splits "
                      f"{row['best_gbs']:.0f} GB/s{best_launch(row)}", flush=True)
            else:
                print(f"batch {batch:3d} context {context:5d}: WRONG (max abs error {row['max_abs_error']:.3g}), not timed")
            rows.append(row)
    output = args.output or default_output("step06_paged_attention", "kernel-bench", "cuda")
    write_json(output, header | {"points": rows})
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
