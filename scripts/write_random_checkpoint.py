"""Write a random-weights model (`random:<config>` or `tiny-<arch>`) as a Hugging Face checkpoint folder: config.json,
the embedded model's tokenizer files, and safetensors shards with their index. Any server that loads a Hugging Face
folder then runs the same weights as this project's (`--model FOLDER`): step 08's peer comparison serves one folder
from both. The weights are those `load_model` gives the same name and seed.

    .venv/bin/python scripts/write_random_checkpoint.py random:qwen2.5-7b /tmp/qwen7b-random --device cuda
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.config import load_bundled_config, tiny_config
from common.loading import embedded_tokenizer_dir, random_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def write_checkpoint(name: str, folder: Path, device: torch.device, dtype: torch.dtype, seed: int = 0,
                     shard_bytes: int = 4 * 2**30, tokenizer_dir: Path | None = None) -> list[Path]:
    """The folder's files, written; returns the shards."""
    config = (tiny_config(name.removeprefix("tiny-")) if name.startswith("tiny-")
              else load_bundled_config(name.removeprefix("random:")))
    folder.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    source = tokenizer_dir or embedded_tokenizer_dir()
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copy(source / file, folder / file)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for tensor_name, tensor in random_weights(config, device, dtype, seed):
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][tensor_name] = tensor.cpu()
        size += tensor.nbytes
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        path = folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        paths.append(path)
        weight_map |= {tensor_name: path.name for tensor_name in shard}
    total = sum(t.nbytes for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="random:<bundled config> or tiny-<arch>")
    p.add_argument("folder", type=Path)
    p.add_argument("--device", default="cpu", help="where the weights are generated (cuda is fast for 7B)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="where the tokenizer files are (default: the embedded model's)")
    args = p.parse_args()
    shards = write_checkpoint(args.model, args.folder, torch.device(args.device), getattr(torch, args.dtype),
                              args.seed, tokenizer_dir=args.tokenizer_dir)
    print(f"wrote {args.folder}: {len(shards)} shards")


if __name__ == "__main__":
    main()
