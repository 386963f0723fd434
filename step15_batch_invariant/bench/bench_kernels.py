"""The batch-invariant kernels on a GPU: are their bits the same in every launch, and what does each launch cost?

Two parts, each timed as a replayed CUDA graph (`common.timing.timed_ms`), so a figure is the GPU's time per call:

- `matmul`: each linear layer of a model (Qwen2.5-7B's by default) at 1, 8, 64 and 256 rows, by cuBLAS and by
  `invariant_matmul` in every tile of a sweep (rows by features by K per step, and pipeline stages). For each
  tile: whether every output has the bits of the engine's own tile (`tile_for`), and whether row 0 has the
  bits it has multiplied alone. This sweep is where `tile_for`'s choices come from.
- `attention`: decode attention at batches of 1 to 64 and contexts of 160 to 4,096 tokens, three ways: step
  06's decode kernel (splits chosen by the batch), and step 15's `pieces_decode` with one worker per (request,
  KV head) and with as many as the engine picks for the batch; whether both give each token the bits it gets
  as a one-row prefill chunk.

    python step15_batch_invariant/bench/bench_kernels.py --output results/gpu/batch-invariance-kernels.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, Parser, check_device, fail, parse_names, parse_sizes
from common.config import ModelConfig, bundled_config_names, load_bundled_config
from common.timing import timed_ms
from step06_paged_attention.backends import TritonBackend
from step06_paged_attention.triton_kernels import paged_decode, paged_prefill
from step15_batch_invariant.attention import InvariantTritonBackend
from step15_batch_invariant.decode_kernel import attend_in_pieces, pieces_decode
from step15_batch_invariant.matmul_kernel import MatmulTile, invariant_matmul, multiprocessors, tile_for

PARTS = ("matmul", "attention")
REPEATS = 20
BLOCK_SIZE = 16
SHARED_MEMORY = 200 * 1024  # bytes a program may use on the H200 (227 KiB), less room for the compiler's own


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(features out, features in) of each multiply of a decode step, as the engine packs them (step 13)."""
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    return {"qkv": (qkv, config.hidden_size), "o": (config.hidden_size, config.num_heads * config.head_dim),
            "gate_up": (2 * config.intermediate_size, config.hidden_size),
            "down": (config.hidden_size, config.intermediate_size), "lm_head": (config.vocab_size, config.hidden_size)}


def tiles_tried(rows: int) -> list[MatmulTile]:
    """Decode: row bands of 16 up to 16 rows, of 32 or 64 up to 64; 16 to 64 features; 128 or 256 of K. More
    rows (a prefill, or a decode of many sequences): 32 to 128 rows by 32 to 128 features by 64 to 256 of K,
    on 4 warps (8 too for 128 rows). 3 or 4 stages, where the pipeline (each stage holds a bf16 tile of x and
    one of the weight) fits in SHARED_MEMORY."""
    if rows > 64:
        tiles = [MatmulTile(m, n, k, w, s) for m, n in ((32, 64), (64, 32), (64, 64), (64, 128), (128, 64), (128, 128))
                 for k in (64, 128, 256) for w in ((4, 8) if m == 128 else (4,)) for s in (3, 4)]
    else:
        tiles = [MatmulTile(m, n, k, num_stages=s) for m in ((16,) if rows <= 16 else (32, 64)) for n in (16, 32, 64)
                 for k in (128, 256) for s in (3, 4)]
    return [t for t in tiles if (t.block_m + t.block_n) * t.block_k * 2 * t.num_stages <= SHARED_MEMORY]


def tile_name(tile: MatmulTile) -> str:
    return f"{tile.block_m}x{tile.block_n}x{tile.block_k} s{tile.num_stages} w{tile.num_warps}"


def matmul_part(config: ModelConfig, device: torch.device, rows_list: list[int]) -> list[dict[str, Any]]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    results = []
    for name, (n, k) in linear_shapes(config).items():
        weight = (torch.randn(n, k, generator=gen) * 0.02).to(device, torch.bfloat16)
        x_all = torch.randn(max(rows_list), k, generator=gen).to(device, torch.bfloat16)
        alone = invariant_matmul(x_all[:1], weight)[0]  # row 0 multiplied by itself, with the engine's tile
        for rows in rows_list:
            x = x_all[:rows]
            engine_tile = tile_for(rows, n, k, 2, multiprocessors(device))
            reference = invariant_matmul(x, weight, tile=engine_tile)
            point: dict[str, Any] = {"linear": name, "n": n, "k": k, "rows": rows,
                                     "engine_tile": tile_name(engine_tile),
                                     "cublas_ms": timed_ms(lambda: F.linear(x, weight), REPEATS), "tiles": {}}
            for tile in tiles_tried(rows) + ([engine_tile] if engine_tile not in tiles_tried(rows) else []):
                out = invariant_matmul(x, weight, tile=tile)
                point["tiles"][tile_name(tile)] = {
                    "ms": timed_ms(lambda: invariant_matmul(x, weight, tile=tile), REPEATS),
                    "same_as_engine_tile": torch.equal(out, reference), "row_same_as_alone": torch.equal(out[0], alone)}
            best = min(point["tiles"], key=lambda t: point["tiles"][t]["ms"])
            point["best_tile"] = best
            print(f"{name:<8} {rows:>3} rows: cuBLAS {point['cublas_ms'] * 1e3:7.1f} us, engine tile "
                  f"{point['tiles'][point['engine_tile']]['ms'] * 1e3:7.1f} us, best {best} "
                  f"{point['tiles'][best]['ms'] * 1e3:7.1f} us; all bits the same: "
                  f"{all(t['same_as_engine_tile'] and t['row_same_as_alone'] for t in point['tiles'].values())}")
            results.append(point)
    return results


class DecodeCase:
    """`batch` sequences of `context` tokens each in a shuffled paged pool, and one new query token each."""

    def __init__(self, config: ModelConfig, device: torch.device, batch: int, context: int) -> None:
        gen = torch.Generator(device="cpu").manual_seed(batch * 7919 + context)
        per_seq = -(-context // BLOCK_SIZE)
        blocks = torch.randperm(batch * per_seq, generator=gen)
        shape = (batch * per_seq, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.k = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
        self.v = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
        self.table = blocks.view(batch, per_seq).to(device, torch.int32)
        self.q = torch.randn(batch, config.num_heads, config.head_dim, generator=gen).to(device, torch.bfloat16)
        self.lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.context = context
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.splits = TritonBackend(sms).num_splits(batch, config.num_kv_heads, context)
        self.workers = InvariantTritonBackend(sms).num_splits(batch, config.num_kv_heads, context)

    def as_prefill_rows(self) -> torch.Tensor:
        """Each new token as a one-row prefill chunk, summed in step 15's pieces: the bits a decode must give."""
        return paged_prefill(self.q, self.k, self.v, self.table, self.cu, self.lens, 1, attend=attend_in_pieces)

    def ways(self) -> dict[str, Callable[[], torch.Tensor]]:
        def step15(workers: int) -> Callable[[], torch.Tensor]:
            return lambda: pieces_decode(self.q, self.k, self.v, self.table, self.lens, self.context, workers)

        return {"step 06 decode kernel": lambda: paged_decode(self.q, self.k, self.v, self.table, self.lens,
                                                             num_splits=self.splits),
                "step 15, one worker": step15(1), "step 15, workers by the batch": step15(self.workers)}


def attention_part(config: ModelConfig, device: torch.device, batches: list[int],
                   contexts: list[int]) -> list[dict[str, Any]]:
    results = []
    for batch in batches:
        for context in contexts:
            case = DecodeCase(config, device, batch, context)
            ways, prefill_rows = case.ways(), case.as_prefill_rows()
            point = {"batch": batch, "context": context, "decode_splits": case.splits, "step15_workers": case.workers,
                     "same_bits_as_prefill_rows": all(torch.equal(ways[w](), prefill_rows) for w in list(ways)[1:]),
                     "ms": {name: timed_ms(way, REPEATS) for name, way in ways.items()}}
            print(f"batch {batch:>3} x {context:>5} tokens: " + ", ".join(
                f"{name}: {ms * 1e3:.1f} us" for name, ms in point["ms"].items())
                + f"; step 15 = prefill bits: {point['same_bits_as_prefill_rows']}")
            results.append(point)
            del case
    return results


def main() -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-7b", choices=bundled_config_names(), help="the model's shapes")
    p.add_argument("--parts", default="matmul,attention", help=f"comma-separated, of: {', '.join(PARTS)}")
    p.add_argument("--rows", default="1,8,64,256", help="rows of the multiplies timed (256: a prefill chunk)")
    p.add_argument("--batches", default="1,8,64", help="decode batches of the attention part")
    p.add_argument("--contexts", default="160,1024,4096", help="tokens per sequence in the attention part")
    p.add_argument("--output", type=Path, default=None, help="evidence file (default runs/step15_batch_invariant/...)")
    args = p.parse_args()
    try:
        check_device("cuda")
        parts = parse_names("--parts", args.parts, PARTS)
        rows, batches, contexts = (parse_sizes(f, v) for f, v in (("--rows", args.rows), ("--batches", args.batches),
                                                                  ("--contexts", args.contexts)))
    except CommandLineError as err:
        return fail(err)
    device = torch.device("cuda")
    config = load_bundled_config(args.config)
    doc: dict[str, Any] = evidence_header(device, f"shapes of {args.config}", torch.bfloat16,
                                          step="step15_batch_invariant", parts=parts, layers=config.num_layers)
    with torch.inference_mode():
        if "matmul" in parts:
            doc["matmul"] = matmul_part(config, device, rows)
        if "attention" in parts:
            doc["attention"] = attention_part(config, device, batches, contexts)
    write_json(args.output or default_output("step15_batch_invariant", "kernels", "cuda", args.config), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
