"""Exercise 04-shard-layer: cut one decoder layer down to one rank's share of it.

Write the body of `shard_layer`; `python -m exercises run 04-shard-layer` plugs it into step 04's sharding in
place of `step04_multi_gpu.sharding.shard_layer` and runs step 04's tests and dry run on it. (The dry run's
other ranks are started afresh and use the project's code: your function cuts rank 0's share.)
"""

from __future__ import annotations

import torch.distributed as dist

from common.model import DecoderLayer


def shard_layer(layer: DecoderLayer, rank: int, size: int, group: dist.ProcessGroup | None) -> None:
    """Cut `layer` down, in place, to what rank `rank` of `size` holds.

    A linear layer `y = x W^T` (W: [out_features, in_features]) splits two ways:
    - by columns of the layer (rows of W, its output features): rank r keeps rows r * out/size .. (r + 1) *
      out/size - 1 of W (and of the bias), and computes that slice of y from the whole x. `split_linear(linear,
      rank, size)` does this in place.
    - by rows of the layer (columns of W, its input features): rank r keeps W's columns for its slice of x, and
      its product is a partial sum of the whole y. `RowParallelLinear(columns_of(W, rank, size), group)` keeps
      them and adds every rank's partial sum with an all-reduce.

    In the layer (`layer.self_attn`, `layer.mlp`): q_proj, k_proj, v_proj, gate_proj and up_proj split by
    columns, so a rank computes whole heads and whole MLP features of its own; o_proj and down_proj (which
    read those heads and features) split by rows. The attention module must then count only its heads:
    `num_heads` and `num_kv_heads` divided by `size`.

    Example: 6 query heads of 8 dims, 2 KV heads, size 2, rank 1: q_proj keeps W rows 24..47 (heads 3, 4, 5),
    k_proj and v_proj rows 8..15 (KV head 1), o_proj W columns 24..47; num_heads 3, num_kv_heads 1.

    Hints (step04_multi_gpu/README.md, "The idea"): `split_linear`, `columns_of` and `RowParallelLinear` are
    in `step04_multi_gpu.sharding`; replace o_proj and down_proj by new modules (assign the attribute).
    """
    raise NotImplementedError("write step04_multi_gpu.sharding.shard_layer: see the hints in its docstring")
