"""Draw step 04's picture: what each rank holds of a decoder layer, and where the ranks exchange.

    .venv/bin/python scripts/draw_tensor_parallel.py            # the embedded SmolLM2-135M over 3 ranks
    .venv/bin/python scripts/draw_tensor_parallel.py --ranks 1  # any size that divides its heads

The shapes are read from the model as `step04_multi_gpu.sharding.shard_model` leaves it on each rank (no
process group is needed to cut it; the all-reduces only run in a forward).
"""

from __future__ import annotations

import argparse
import copy

import torch

from common.loading import EMBEDDED_MODEL, load_model
from step04_multi_gpu.sharding import shard_model


def shape(tensor: torch.Tensor) -> str:
    return "[" + ",".join(str(n) for n in tensor.shape) + "]"


def span(start: int, count: int) -> str:
    return f"{start:,}" if count == 1 else f"{start:,}-{start + count - 1:,}"


LABEL, CELL = 20, 22


def row(label: str, cells: list[str]) -> str:
    return (f"{label:<{LABEL}}" + "".join(f"{cell:<{CELL}}" for cell in cells)).rstrip()


def exchange(ranks: int, what: str) -> str:
    """A line under the ranks' cells: their partial results meet in one collective."""
    inner = ranks * CELL - 4
    text = f" {what} "
    left = (inner - len(text)) // 2
    return " " * LABEL + "└" + "─" * left + text + "─" * (inner - left - len(text)) + "┘"


def drawing(model_name: str, ranks: int) -> str:
    whole = load_model(model_name, "cpu", torch.float32, 0).model
    config = whole.config
    shards = [shard_model(copy.deepcopy(whole), rank, ranks) for rank in range(ranks)]
    layers = [shard.model.layers[0] for shard in shards]
    embeddings = [shard.model.embed_tokens for shard in shards]
    heads, kv_heads = config.num_heads // ranks, config.num_kv_heads // ranks
    features = config.intermediate_size // ranks
    if ranks == 1:
        return f"{model_name} on one rank: every weight whole, no all-reduce"
    return "\n".join([
        f"{model_name} over {ranks} ranks: hidden {config.hidden_size}, {config.num_heads} query heads and "
        f"{config.num_kv_heads} KV heads",
        f"of {config.head_dim} dims, {config.intermediate_size:,} MLP features, {config.num_layers} layers "
        f"(one drawn), a vocabulary of {config.vocab_size:,}",
        "",
        row("", [f"rank {r}" for r in range(ranks)]),
        row("x", [f"[tokens,{config.hidden_size}], whole"] * ranks),
        row("q_proj (columns)", [shape(l.self_attn.q_proj.weight) for l in layers]),
        row("  query heads", [span(r * heads, heads) for r in range(ranks)]),
        row("k_proj, v_proj", [shape(l.self_attn.k_proj.weight) + " each" for l in layers]),
        row("  KV heads", [span(r * kv_heads, kv_heads) + ", in its KV pool" for r in range(ranks)]),
        row("o_proj (rows)", [shape(l.self_attn.o_proj.weight) + " partial sum" for l in layers]),
        exchange(ranks, "all-reduce: every rank holds x + attention"),
        row("gate, up (columns)", [shape(l.mlp.gate_proj.weight) + " each" for l in layers]),
        row("  MLP features", [span(r * features, features) for r in range(ranks)]),
        row("down (rows)", [shape(l.mlp.down_proj.weight) + " partial sum" for l in layers]),
        exchange(ranks, "all-reduce: every rank holds x + MLP"),
        "",
        row("embedding", [f"ids {span(getattr(e, 'start', 0), e.weight.shape[0])}" for e in embeddings]),
        exchange(ranks, "all-reduce (other ids look up zeros)"),
        row("output head", [f"logits {span(getattr(e, 'start', 0), e.weight.shape[0])}" for e in embeddings]),
        exchange(ranks, "all-gather: every rank holds every logit"),
        "",
        f"one forward: 2 x {config.num_layers} layers + 1 embedding = {2 * config.num_layers + 1} all-reduces "
        f"of {config.hidden_size} numbers a token",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--ranks", type=int, default=3)
    args = parser.parse_args()
    print(drawing(args.model, args.ranks))


if __name__ == "__main__":
    main()
