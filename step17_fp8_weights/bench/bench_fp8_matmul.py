"""Time each of a model's four projection shapes with FP8 weights: our kernel (`fp8_matmul`), cuBLAS's FP8 multiply
(`torch._scaled_mm`, with one scale per tensor and with one per row) and bf16 `F.linear`, at decode's row counts.

Each point reports microseconds and the weight's bytes over that time, beside the device's copy bandwidth: at one
byte a weight, a read-bound multiply lasts at least n * k bytes / bandwidth. Our kernel is timed at every setting of
a small grid and its best kept (the default, `fp8_config`'s, is reported too). Each call reads a different copy of
the weight (copies holding several times the L2 cache), as 28 layers do; timing replays a CUDA graph of many calls
(`common.timing.timed_ms`). cuBLAS's FP8 is timed as the engine would call it: the activations quantized to e4m3 in
the same call, per tensor or per row. Writes JSON evidence.

    python step17_fp8_weights/bench/bench_fp8_matmul.py --config qwen2.5-7b --rows 1,8,64,256
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton

from common.bench import default_output, evidence_header, write_json
from common.config import load_bundled_config
from common.timing import copy_bandwidth_gbs, timed_ms
from step13_fused_decode.bench.matmul_bench import (L2_MULTIPLE, parse_gpu_bench_args, projection_shapes,
                                                   shape_bench_parser)
from step17_fp8_weights.fp8 import E4M3, E4M3_MAX, quantize
from step17_fp8_weights.fp8_matmul import (MAX_ROWS, Fp8Config, fp8_config, fp8_matmul, quantize_rows,
                                           scaled_mm_rowwise)

# Bands of 32 with 4 warps and of 64 with 2 (fewer warps each reading the x tile from shared memory), 256 or 512 of K
# per iteration, K in 1 to 8 parts. 8 warps never won at 1 or 8 rows on the H100, nor did the weight's tiles first
# in the multiply (W x^T, wgmma on Hopper; results/gpu/fp8-matmul-orders.json).
GRID = [Fp8Config(n, k, warps, 3, split) for (n, warps), k, split in itertools.product(
    ((32, 4), (64, 2)), (256, 512), (1, 2, 4, 8))]


def scaled_mm_per_tensor(x: torch.Tensor, values: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """cuBLAS's FP8 multiply with one scale for all of x and one for the whole weight (the fastest it offers)."""
    x_scale = (x.abs().amax().float() / E4M3_MAX).clamp(min=1e-12)
    return torch._scaled_mm((x.float() / x_scale).to(E4M3), values.t(), scale_a=x_scale, scale_b=weight_scale,
                             out_dtype=x.dtype)


def scaled_mm_per_row(x: torch.Tensor, values: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """cuBLAS's FP8 multiply with a scale per row of x and per row of the weight, as `fp8_linear` calls it."""
    return scaled_mm_rowwise(*quantize_rows(x), values, weight_scale, None, x.dtype)


def point(name: str, us: float, weight_bytes: int, bandwidth_gbs: float, **extra: object) -> dict:
    gbs = weight_bytes / (us * 1e-6) / 1e9
    return {"kernel": name, "us": us, "weight_bytes": weight_bytes, "gbs": gbs, "share_of_copy": gbs / bandwidth_gbs,
            **extra}


def bench_shape(n: int, k: int, rows_tried: list[int], bandwidth_gbs: float, repeats: int, sweep: bool) -> list[dict]:
    device = torch.device("cuda")
    copies = max(2, -(-L2_MULTIPLE * 50 * 2**20 // (n * k * 2)))  # sized for bf16's copies, the larger
    dense = [torch.randn(n, k, dtype=torch.bfloat16, device=device) * k**-0.5 for _ in range(copies)]
    per_row = [quantize(w) for w in dense]
    per_tensor = [quantize(w, per_row=False) for w in dense]
    points = []
    for rows in rows_tried:
        x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
        expected = F.linear(x.float(), per_row[0].dequantize())
        turn = itertools.count()

        def error_of(got: torch.Tensor) -> float:
            return ((got.float() - expected).abs().max() / expected.abs().max()).item()

        results = [
            point("bf16 F.linear", 1e3 * timed_ms(lambda: F.linear(x, dense[next(turn) % copies]), repeats),
                  2 * n * k, bandwidth_gbs),
            point("_scaled_mm per tensor", 1e3 * timed_ms(lambda: scaled_mm_per_tensor(
                x, *vars(per_tensor[next(turn) % copies]).values()), repeats), n * k, bandwidth_gbs),
            point("_scaled_mm per row", 1e3 * timed_ms(lambda: scaled_mm_per_row(
                x, *vars(per_row[next(turn) % copies]).values()), repeats), n * k, bandwidth_gbs,
                error=error_of(scaled_mm_per_row(x, per_row[0].values, per_row[0].scale))),
        ]
        if rows <= MAX_ROWS:
            block_m = max(16, triton.next_power_of_2(rows))
            default = fp8_config(block_m, x.element_size(), device, n, k)
            settings = []
            for config in dict.fromkeys([default, *(GRID if sweep else [])]):
                try:
                    error = error_of(fp8_matmul(x, per_row[0].values, per_row[0].scale, config=config))
                except triton.runtime.errors.OutOfResources:  # the pipeline's buffers exceed shared memory
                    continue
                if error > 2e-2:
                    print(f"  {n}x{k} rows {rows} {config}: WRONG (relative error {error:.3g}), not timed")
                    settings.append({"config": vars(config), "error": error, "us": None})
                    continue
                us = 1e3 * timed_ms(lambda: fp8_matmul(  # noqa: B023 (called before config changes)
                    x, *vars(per_row[next(turn) % copies]).values(), config=config), repeats)  # noqa: B023
                settings.append({"config": vars(config), "error": error, "us": us})
            timed = [s for s in settings if s["us"] is not None]
            default_us = next(s["us"] for s in settings if s["config"] == vars(default))
            best = min(timed, key=lambda s: s["us"])
            results.append(point("fp8_matmul (ours)", default_us, n * k, bandwidth_gbs, config=vars(default),
                                 error=next(s["error"] for s in settings if s["config"] == vars(default))))
            results.append(point("fp8_matmul best of grid", best["us"], n * k, bandwidth_gbs, config=best["config"],
                                 settings=settings))
        line = "; ".join(f"{r['kernel']} {r['us']:.1f} us ({r['share_of_copy']:.0%})" for r in results)
        print(f"{n}x{k} rows {rows}: {line}", flush=True)
        points.append({"n": n, "k": k, "rows": rows, "copies": copies, "results": results})
    return points


def main() -> int:
    p = shape_bench_parser(__doc__, "1,8,64,256", "runs/step17_fp8_weights/fp8-matmul-cuda-<config>.json")
    p.add_argument("--no-sweep", action="store_true", help="time our kernel at its default settings only")
    parsed = parse_gpu_bench_args(p)
    if isinstance(parsed, int):
        return parsed
    args, rows_tried = parsed
    device = torch.device("cuda")
    bandwidth = copy_bandwidth_gbs(device)
    header = evidence_header(device, f"shapes of {args.config}", torch.bfloat16, rows=rows_tried,
                             copy_bandwidth_gbs=bandwidth, grid_size=0 if args.no_sweep else len(GRID))
    shapes = {name: bench_shape(n, k, rows_tried, bandwidth, args.repeats, not args.no_sweep)
              for name, (n, k, _) in projection_shapes(load_bundled_config(args.config)).items() if name != "lm_head"}
    write_json(args.output or default_output("step17_fp8_weights", "fp8-matmul-cuda", args.config),
               header | {"shapes": shapes})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
