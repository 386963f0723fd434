"""Check, then time, the paged prefill kernel on chunks of new tokens over a long cached prefix.

A chunk of `q_len` new tokens (one request, and `decoders` one-token requests beside it, as step 09's mixed
steps run) attends to a cached prefix of `context` tokens. For each launch configuration (query rows per
program, keys per tile, warps, pipeline stages) the kernel's output is first compared with a float32 torch
reference (a configuration that fails is reported and not timed), then timed on the GPU with CUDA events.
Reported: milliseconds per call and the attention's useful TFLOP/s (4 x new tokens x keys they see x
head_dim x heads, causal). Writes JSON evidence (by default runs/step06_paged_attention/prefill-kernel-bench-cuda.json).

    .venv/bin/python step06_paged_attention/bench/prefill_kernel_bench.py --points 256x16384,1024x16384
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, Parser, fail
from common.config import load_bundled_config
from common.timing import call_timed_ms
from step06_paged_attention import triton_kernels

# (rows per program, keys per tile, warps, stages); the kernel's default is (64, 64, 4, 3).
CONFIGS = [(32, 32, 4, 3), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 8, 3),
           (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 3), (128, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
           (128, 64, 4, 2)]


def parse_points(text: str) -> list[tuple[int, int]]:
    points = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", part)
        if not match or not 1 <= int(match[1]) <= int(match[2]):
            raise CommandLineError(f"--points takes NEWxCONTEXT pairs with 1 <= NEW <= CONTEXT (got {text!r})")
        points.append((int(match[1]), int(match[2])))
    return points


def bench_point(q_len: int, context: int, decoders: int, heads: int, kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype) -> list[dict]:
    device = torch.device("cuda")
    contexts = [context] + [64 + 37 * i for i in range(decoders)]  # decoders: short contexts, one new token
    q_lens = [q_len] + [1] * decoders
    need = [-(-c // block_size) for c in contexts]
    blocks = list(range(sum(need)))
    random.Random(0).shuffle(blocks)
    rows, at = [], 0
    for n in need:
        rows.append(blocks[at : at + n] + [0] * (max(need) - n))
        at += n
    table = torch.tensor(rows, dtype=torch.int32, device=device)
    shape = (sum(need), block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    # The long request's reference, in float32 (the decoders are checked by the kernel tests).
    keys = k_cache[table[0, : need[0]].long()].flatten(0, 1)[:context].float()
    values = v_cache[table[0, : need[0]].long()].flatten(0, 1)[:context].float()
    mask = torch.arange(context, device=device)[None, :] <= (context - q_len + torch.arange(q_len, device=device))[:, None]
    expected = F.scaled_dot_product_attention(q[:q_len].float().transpose(0, 1), keys.transpose(0, 1),
                                              values.transpose(0, 1), attn_mask=mask, enable_gqa=True).transpose(0, 1)
    flops = 4 * head_dim * heads * sum(context - q_len + i + 1 for i in range(q_len))
    results = []
    for block_m, tile, warps, stages in CONFIGS:
        def call() -> torch.Tensor:
            return triton_kernels.paged_prefill(q, k_cache, v_cache, table, cu, ctx, q_len, block_m=block_m,
                                                tile=tile, num_warps=warps, num_stages=stages)
        row = {"q_len": q_len, "context": context, "decoders": decoders, "block_m": block_m, "tile": tile,
               "num_warps": warps, "num_stages": stages}
        try:
            error = (call()[:q_len].float() - expected).abs().max().item()
        except Exception as err:  # noqa: BLE001 - a launch configuration Triton refuses (too much shared memory)
            results.append(row | {"error": f"{type(err).__name__}: {str(err)[:200]}"})
            continue
        row["max_abs_error"] = error
        if error > 0.05:
            results.append(row | {"error": "output differs from the reference"})
            continue
        ms = call_timed_ms(call)
        results.append(row | {"ms": ms, "tflops": flops / ms / 1e9})
        print(f"new {q_len:5d} context {context:6d} +{decoders} decoders  rows {block_m:3d} tile {tile:3d} "
              f"warps {warps} stages {stages}: {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-7b", help="a bundled model config: its heads and head_dim")
    p.add_argument("--points", default="256x4096,256x16384,1024x4096,1024x16384,2048x2048")
    p.add_argument("--decoders", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        points = parse_points(args.points)
        if not torch.cuda.is_available():
            raise CommandLineError("this benchmark times GPU kernels: run it on a CUDA machine")
    except CommandLineError as err:
        return fail(err)
    config = load_bundled_config(args.config)
    device, dtype = torch.device("cuda"), torch.bfloat16
    header = evidence_header(device, f"config:{args.config}", dtype, block_size=args.block_size, decoders=args.decoders)
    rows = [row for q_len, context in points
            for row in bench_point(q_len, context, args.decoders, config.num_heads, config.num_kv_heads,
                                   config.head_dim, args.block_size, dtype)]
    write_json(args.output or default_output("step06_paged_attention", "prefill-kernel-bench", "cuda"),
               header | {"configs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
