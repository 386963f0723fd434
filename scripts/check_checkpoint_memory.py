"""Proof that a checkpoint loads without two copies on the GPU: write a 7B checkpoint, load it, read the peak.

Writes random:qwen2.5-7b weights (bf16, 15.2 GB) as sharded safetensors into a folder, frees the GPU, loads
the folder with `common.loading.load_model` and records `torch.cuda.max_memory_allocated`. A loader that
built the model on the GPU and then copied weights in would peak near twice the weights.

    PYTHONPATH=. python scripts/check_checkpoint_memory.py --folder /tmp/ckpt7b --output result.json
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.bench import evidence_header, write_json
from common.loading import EMBEDDED_MODEL, cache_dir, load_model

SHARD_BYTES = 5 * 2**30


def write_checkpoint(model_name: str, folder: Path) -> int:
    loaded = load_model(model_name, "cuda", torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(loaded.model.config.to_hf()))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(cache_dir() / EMBEDDED_MODEL / name, folder / name)
    state = {k: v for k, v in loaded.model.state_dict().items() if not (
        loaded.model.config.tie_word_embeddings and k == "lm_head.weight")}
    shard: dict[str, torch.Tensor] = {}
    size = index = total = 0
    for key, tensor in state.items():
        shard[key] = tensor.cpu()
        size += tensor.nbytes
        total += tensor.nbytes
        if size >= SHARD_BYTES:
            save_file(shard, str(folder / f"model-{index:05d}.safetensors"))
            shard, size, index = {}, 0, index + 1
    if shard:
        save_file(shard, str(folder / f"model-{index:05d}.safetensors"))
    del loaded, state, shard
    gc.collect()
    torch.cuda.empty_cache()
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="random:qwen2.5-7b")
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args()
    weight_bytes = write_checkpoint(args.model, args.folder)
    torch.cuda.reset_peak_memory_stats()
    load_model(str(args.folder), "cuda", torch.bfloat16)
    peak = torch.cuda.max_memory_allocated()
    result = {
        **evidence_header(torch.device("cuda"), args.model, torch.bfloat16, check="checkpoint load peak memory"),
        "weight_bytes": weight_bytes,
        "peak_allocated_bytes": peak,
        "peak_over_weights": peak / weight_bytes,
    }
    write_json(args.output, result)
    print(f"weights {weight_bytes / 1e9:.2f} GB, peak allocated while loading {peak / 1e9:.2f} GB "
          f"({peak / weight_bytes:.3f}x the weights)")


if __name__ == "__main__":
    main()
