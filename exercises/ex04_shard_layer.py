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

    Inputs: one whole decoder layer (`layer.self_attn` with q_proj, k_proj, v_proj, o_proj, `num_heads`,
    `num_kv_heads`; `layer.mlp` with gate_proj, up_proj, down_proj, all `nn.Linear`, `y = x W^T`, W
    `[out_features, in_features]`); `size` divides the heads and the MLP features; `group` is the ranks'
    process group. Returns nothing: the layer is changed in place.
    Rule: q, k, v, gate and up are split by columns of the layer (rank r keeps its 1/size of W's rows, its
    output features), so a rank computes whole heads and whole MLP features of its own. o_proj and down_proj,
    which read those, are split by rows of the layer (rank r keeps its 1/size of W's columns, its input
    features): each rank's product is then a partial sum of the whole output, and the ranks' partial sums must
    be added by an all-reduce before the layer goes on. The attention counts only its own heads.

    Example: 6 query heads of 8 dims, 2 KV heads, size 2, rank 1: q_proj keeps W rows 24..47 (heads 3, 4, 5),
    k_proj and v_proj rows 8..15 (KV head 1), o_proj W columns 24..47 and an all-reduce of its output;
    num_heads 3, num_kv_heads 1.

    Hints (step04_multi_gpu/README.md, "The idea"): `step04_multi_gpu.sharding` has the pieces: `split_linear`
    (a column split, in place), `columns_of` (a rank's columns of a weight) and `RowParallelLinear` (a row split
    and its all-reduce); a module that replaces another is assigned to the attribute.
    """
    raise NotImplementedError("write step04_multi_gpu.sharding.shard_layer: see the hints in its docstring")
