"""Which of a forward's operations give a row other bits when other rows share its call, on this machine.

Each op computes one fixed row alone, then inside calls of more rows (the row last, after random
neighbours; or a sequence beside longer ones); the row's output is compared bit for bit with the one it had alone, and the largest difference
is kept. The ops, each first as steps 06 to 14 run it and then as step 15 does:

- a linear layer (the model's gate projection), in calls of 1 to 256 rows;
- RMSNorm, the same;
- decode attention of a 600-token sequence beside longer ones (up to 2,000 tokens);
- the same token's attention as the last row of a prefill chunk of 1 to 64 tokens (a budget's chunk), and
  inside a chunk that goes on for 1 to 40 tokens after it;
- on a GPU, one call of our multiply through each of the tile shapes the engine picks by row count.

Writes JSON evidence (`--output`) and prints a table: "same" where every bit matched.

    .venv/bin/python step15_batch_invariant/bench/probe.py --output results/cpu/batch-invariance-probe.json
    python step15_batch_invariant/bench/probe.py --device cuda --output results/gpu/batch-invariance-probe.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.bench import evidence_header, write_json
from common.cli import Parser, check_device
from common.config import ModelConfig, bundled_config_names, load_bundled_config
from common.model import RMSNorm
from step06_paged_attention.backends import AttentionBackend, AttentionMetadata, create_backend
from step15_batch_invariant.attention import InvariantTorchBackend, InvariantTritonBackend
from step15_batch_invariant.invariant_ops import InvariantRMSNorm, invariant_linear

BATCHES = (1, 2, 3, 8, 16, 64, 256)
CHUNKS = (1, 2, 8, 16, 64)  # prefill chunk sizes: how many of the sequence's last tokens one forward computes
LATER = (0, 1, 8, 40)  # tokens a 16-token chunk holds after the probed one (0: the token decoded alone)
ROW_LEN = 600  # the probed sequence's length
BLOCK_SIZE = 16


def drift(row_in_call: Callable[[int], torch.Tensor], sizes: tuple[int, ...]) -> dict[str, dict[str, object]]:
    """For each call size: whether the probed row came out bit for bit as in the first size, and by how much
    it differs."""
    alone = row_in_call(sizes[0])
    result = {}
    for size in sizes:
        row = row_in_call(size)
        result[str(size)] = {"same": torch.equal(row, alone),
                             "max_abs_diff": (row.float() - alone.float()).abs().max().item()}
    return result


class AttentionCase:
    """A paged KV cache holding the probed sequence (blocks from 0) and longer neighbours after it."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, max_batch: int) -> None:
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.lens = [ROW_LEN] + torch.randint(ROW_LEN, 2000, (max_batch - 1,), generator=gen).tolist()
        # The probed sequence's cache also holds the LATER tokens after it, for chunks that go on past it.
        self.blocks = [-(-n // BLOCK_SIZE) for n in [ROW_LEN + max(LATER), *self.lens[1:]]]
        shape = (sum(self.blocks), BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.k = torch.randn(shape, generator=gen).to(device, dtype)
        self.v = torch.randn(shape, generator=gen).to(device, dtype)
        self.q = torch.randn(ROW_LEN + max(LATER), config.num_heads, config.head_dim, generator=gen).to(device, dtype)
        # Decode queries: the probed sequence's newest token first, then each neighbour's.
        self.decode_q = torch.cat([self.q[ROW_LEN - 1:ROW_LEN], torch.randn(max_batch - 1, *self.q.shape[1:], generator=gen).to(
            device, dtype)])
        self.device = device

    def table(self, rows: int) -> torch.Tensor:
        starts = [sum(self.blocks[:i]) for i in range(rows)]
        width = max(self.blocks[:rows])
        return torch.tensor([[s + j if j < n else 0 for j in range(width)] for s, n in zip(starts, self.blocks)],
                            dtype=torch.int32, device=self.device)

    def meta(self, q_lens: list[int], seq_lens: list[int], is_prefill: bool) -> AttentionMetadata:
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=self.device)
        return AttentionMetadata(is_prefill=is_prefill, slot_mapping=torch.empty(0, device=self.device),
                                 block_table=self.table(len(seq_lens)),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
                                 cu_q_lens=cu, q_lens=q_lens, seq_lens_host=seq_lens, max_q_len=max(q_lens),
                                 max_seq_len=max(seq_lens), block_size=BLOCK_SIZE)

    def decode_row(self, backend: AttentionBackend, batch: int) -> torch.Tensor:
        """The probed sequence's newest token, decoded beside `batch - 1` longer sequences."""
        meta = self.meta([1] * batch, self.lens[:batch], is_prefill=False)
        return backend.decode(self.decode_q[:batch], self.k, self.v, meta)[0]

    def prefill_row(self, backend: AttentionBackend, chunk: int, later: int = 0) -> torch.Tensor:
        """The same token as row `chunk - 1` of a prefill chunk: the sequence's last `chunk` tokens, then `later`
        tokens after it."""
        meta = self.meta([chunk + later], [ROW_LEN + later], is_prefill=True)
        return backend.prefill(self.q[ROW_LEN - chunk:ROW_LEN + later], self.k, self.v, meta)[chunk - 1]


def probe(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> list[dict[str, object]]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(max(BATCHES), config.hidden_size, generator=gen).to(device, dtype)

    def rows(b: int) -> torch.Tensor:  # the probed row x[0] last, after b - 1 neighbours: the end of a tile
        return torch.cat([x[1:b], x[:1]])

    weight = (torch.randn(config.intermediate_size, config.hidden_size, generator=gen) * 0.02).to(device, dtype)
    norm, invariant_norm = RMSNorm(config.hidden_size, config.rms_norm_eps), InvariantRMSNorm(
        config.hidden_size, config.rms_norm_eps)
    norm.to(device, dtype), invariant_norm.to(device, dtype)
    case = AttentionCase(config, device, dtype, max(BATCHES))
    kernels = "triton" if device.type == "cuda" else "torch"
    before = create_backend(kernels, device, BLOCK_SIZE, max(BATCHES))
    after = create_backend(kernels, device, BLOCK_SIZE, max(BATCHES),
                           {"torch": InvariantTorchBackend, "triton": InvariantTritonBackend})
    ops = [
        ("linear", "steps 06-14", BATCHES, lambda b: F.linear(rows(b), weight)[-1]),
        ("linear", "step 15", BATCHES, lambda b: invariant_linear(rows(b), weight)[-1]),
        ("rms_norm", "steps 06-14", BATCHES, lambda b: norm(rows(b))[-1]),
        ("rms_norm", "step 15", BATCHES, lambda b: invariant_norm(rows(b))[-1]),
        ("decode attention beside longer sequences", "steps 06-14", BATCHES, lambda b: case.decode_row(before, b)),
        ("decode attention beside longer sequences", "step 15", BATCHES, lambda b: case.decode_row(after, b)),
        # The first size is 1: a one-token "chunk" is the token decoded (the same call as a decode step's).
        ("the token in a prefill chunk of N tokens", "steps 06-14", CHUNKS,
         lambda c: case.decode_row(before, 1) if c == 1 else case.prefill_row(before, c)),
        ("the token in a prefill chunk of N tokens", "step 15", CHUNKS,
         lambda c: case.decode_row(after, 1) if c == 1 else case.prefill_row(after, c)),
        # Inside a chunk: the row's tile goes on past it, over keys it must not see.
        ("the token with N more after it in a chunk", "steps 06-14", LATER,
         lambda n: case.decode_row(before, 1) if n == 0 else case.prefill_row(before, 16, n)),
        ("the token with N more after it in a chunk", "step 15", LATER,
         lambda n: case.decode_row(after, 1) if n == 0 else case.prefill_row(after, 16, n)),
    ]
    with torch.inference_mode():
        results = [{"op": name, "as_in": where, "sizes": drift(row, sizes)} for name, where, sizes, row in ops]
        if device.type == "cuda":  # Triton compiles for the GPU only (the interpreter's dot is NumPy's)
            results.append({"op": "linear, 64 rows in each tile shape", "as_in": "step 15",
                            "sizes": tile_shapes_agree(x[:64], weight)})
    return results


def tile_shapes_agree(x: torch.Tensor, weight: torch.Tensor) -> dict[str, dict[str, object]]:
    """The same call through each tile shape the engine uses: whether all its outputs have the first's bits."""
    from step15_batch_invariant.matmul_kernel import invariant_matmul, tile_for

    n, k = weight.shape
    engine_tiles = (tile_for(rows, n, k, x.element_size()) for rows in (1, 64, 256))
    tiles = {f"{t.block_m}x{t.block_n}x{t.block_k}": t for t in engine_tiles}
    outs = {name: invariant_matmul(x, weight, tile=tile) for name, tile in tiles.items()}
    first = next(iter(outs.values()))
    return {name: {"same": torch.equal(out, first), "max_abs_diff": (out.float() - first.float()).abs().max().item()}
            for name, out in outs.items()}


def format_table(results: list[dict[str, object]]) -> str:
    lines = []
    for result in results:
        cells = [("same" if r["same"] else f"{r['max_abs_diff']:.1e}") for r in result["sizes"].values()]
        sizes = ", ".join(f"{n}: {c}" for n, c in zip(result["sizes"], cells))
        lines.append(f"{result['op']:<42} {result['as_in']:<12} {sizes}")
    return "\n".join(lines)


def main() -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="cpu, cuda (default: cuda if available)")
    parser.add_argument("--config", default=None, choices=bundled_config_names(),
                        help="the model shapes to probe (default: qwen2.5-7b on a GPU, qwen2.5-0.5b on a CPU)")
    parser.add_argument("--output", default=None, help="write the results as JSON evidence here")
    args = parser.parse_args()
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    check_device(device.type)
    name = args.config or ("qwen2.5-7b" if device.type == "cuda" else "qwen2.5-0.5b")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = probe(load_bundled_config(name), device, dtype)
    print(format_table(results))
    if args.output:
        write_json(args.output, {**evidence_header(device, f"shapes of {name}", dtype), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
