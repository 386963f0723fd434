"""The attention kernels' outputs on fixed inputs, saved, and two such files compared bit for bit: a change that
moves code between a kernel's functions, without changing what it computes, must leave the GPU's bits as they were.

    python scripts/kernel_bits.py save /tmp/new.pt                  # in each tree (PYTHONPATH=. in that tree)
    python scripts/kernel_bits.py compare /tmp/old.pt /tmp/new.pt --output results/gpu/kernel-bits-old-new.json

gpu_suite.sh's `kernel_bits` section runs both trees and the comparison. On a CPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1) on smaller shapes, in float32 only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch

# Sequences of one token to several 1,024-key pieces; Qwen2.5-7B's heads on a GPU, a few small ones on a CPU.
GPU_SHAPES = {"lens": [1, 17, 700, 1500, 3100, 64, 1025, 2048], "heads": (28, 4, 128), "chunk": 200}
CPU_SHAPES = {"lens": [1, 17, 70, 150, 31, 64, 1025, 48], "heads": (4, 2, 32), "chunk": 20}
BLOCK_SIZE, TILE_ROWS = 16, 64


def kernel_outputs(device: torch.device) -> dict[str, torch.Tensor]:
    """Every kernel, each way it is launched: step 06's decode (1, 4, 16 splits) and prefill, step 12's prefill
    tiles, step 15's decode in pieces (1, 4 workers) and its pieces inside the two prefill kernels."""
    from step06_paged_attention.triton_kernels import paged_decode, paged_prefill
    from step12_cuda_graph.prefill_tiles import paged_prefill_tiles
    from step15_batch_invariant.decode_kernel import attend_in_pieces, pieces_decode

    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    heads, kv_heads, head_dim = shapes["heads"]
    lens = shapes["lens"]
    dtypes = (torch.bfloat16, torch.float32) if device.type == "cuda" else (torch.float32,)
    out = {}
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(0)

        def randn(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=gen).to(device, dtype)

        max_blocks = -(-max(lens) // BLOCK_SIZE) + 1
        num_blocks = len(lens) * max_blocks + 1
        k_cache, v_cache = (randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim) for _ in range(2))
        table = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
        table, seq_lens = table.int().to(device), torch.tensor(lens, dtype=torch.int32, device=device)
        q = randn(len(lens), heads, head_dim)
        name = str(dtype).removeprefix("torch.")
        for splits in (1, 4, 16):
            out[f"{name}/decode/{splits}"] = paged_decode(q, k_cache, v_cache, table, seq_lens, num_splits=splits)
        for workers in (1, 4):
            out[f"{name}/pieces_decode/{workers}"] = pieces_decode(q, k_cache, v_cache, table, seq_lens, max(lens),
                                                                   workers)
        q_lens = [min(n, shapes["chunk"]) for n in lens]
        cu_lens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q_prefill = randn(sum(q_lens), heads, head_dim)
        prefill = (q_prefill, k_cache, v_cache, table, cu_lens, seq_lens)
        out[f"{name}/prefill"] = paged_prefill(*prefill, max(q_lens))
        out[f"{name}/prefill_pieces"] = paged_prefill(*prefill, max(q_lens), attend=attend_in_pieces)
        tiles = [(row, tile) for row, n in enumerate(q_lens) for tile in range(-(-n // TILE_ROWS))]
        tile_rows = torch.tensor([r for r, _ in tiles] + [-1] * 3, dtype=torch.int32, device=device)  # 3 padding
        tile_index = torch.tensor([t for _, t in tiles] + [0] * 3, dtype=torch.int32, device=device)
        out[f"{name}/tiles"] = paged_prefill_tiles(*prefill, tile_rows, tile_index, TILE_ROWS)
        out[f"{name}/tiles_pieces"] = paged_prefill_tiles(*prefill, tile_rows, tile_index, TILE_ROWS,
                                                          attend=attend_in_pieces)
    return {key: value.cpu() for key, value in out.items()}


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    save = commands.add_parser("save", help="run every kernel and save its outputs")
    save.add_argument("file", type=Path)
    compare = commands.add_parser("compare", help="which outputs of two saved files have the same bits")
    compare.add_argument("old", type=Path)
    compare.add_argument("new", type=Path)
    compare.add_argument("--output", type=Path, help="write the comparison here as JSON")
    args = parser.parse_args()
    if args.command == "save":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # The tree's commit as gpu_suite.sh names it (the GPU machine's copy has no .git), else git's.
        commit = os.environ.get("LLM_STEPS_GIT_COMMIT") or git_commit()
        torch.save({"git_commit": commit, "outputs": kernel_outputs(device)}, args.file)
        return 0
    old, new = torch.load(args.old), torch.load(args.new)
    if old["outputs"].keys() != new["outputs"].keys():
        raise SystemExit(f"error: the two files hold different outputs: "
                         f"{sorted(old['outputs'].keys() ^ new['outputs'].keys())}")
    same = {key: torch.equal(old["outputs"][key], new["outputs"][key]) for key in old["outputs"]}
    result = {"git_commit": new["git_commit"], "old_commit": old["git_commit"],
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "model": "none: fixed random inputs", "dtype": ", ".join(sorted({k.split("/")[0] for k in same})),
              "torch": torch.__version__, "same_bits": same, "all_same": all(same.values())}
    print(json.dumps(result, indent=1))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["all_same"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
