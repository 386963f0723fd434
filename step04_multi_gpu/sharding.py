"""Tensor parallelism: each of N ranks holds 1/N of every layer's weights, and two all-reduces a layer make the
result whole again.

A linear layer y = x W^T can be split two ways. By columns (rows of W, the output features): each rank computes
its own slice of y from the whole x, with no communication. By rows (columns of W, the input features): each
rank multiplies its slice of x by its slice of W and holds a partial sum of the whole y; an all-reduce adds
the N partial sums. A transformer layer pairs them so the slices line up without moving activations:

- attention: q, k and v split by columns, so a rank computes whole heads (its 1/N of the query heads and of the
  KV heads) and attends over its own heads' KV cache; o_proj split by rows, then an all-reduce;
- MLP: gate and up split by columns (a rank holds 1/N of the intermediate features), down by rows, then an
  all-reduce;
- the embedding and the output head split over the vocabulary: a rank looks up only its ids (the others give
  zeros, summed by an all-reduce) and computes the logits of its slice (joined by an all-gather).

The model stays `common.model.CausalLM`: `shard_model` slices its weights in place and swaps in the three
layers below, and its config says how many heads and features this rank holds, so the engines, their KV pools
and their attention backends work on the shard as on a smaller model.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.config import ModelConfig
from common.model import CausalLM, DecoderLayer


class TensorParallelConfigError(ValueError):
    """A tensor-parallel size the model cannot be split into."""


def sizes_that_divide(config: ModelConfig) -> list[int]:
    """Every tensor-parallel size that splits whole query heads, whole KV heads and whole MLP features."""
    common = math.gcd(config.num_heads, config.num_kv_heads, config.intermediate_size)
    return [n for n in range(1, common + 1) if common % n == 0]


def check_divides(config: ModelConfig, size: int) -> None:
    """Refuse, in one line, a size that does not split whole heads and whole features."""
    if size < 1:
        raise TensorParallelConfigError(f"--tensor-parallel-size must be at least 1, got {size}")
    whole = {"query heads": config.num_heads, "KV heads": config.num_kv_heads,
             "MLP features": config.intermediate_size}
    for what, count in whole.items():
        if count % size:
            sizes = ", ".join(map(str, sizes_that_divide(config)))
            raise TensorParallelConfigError(
                f"--tensor-parallel-size {size} does not divide the model's {count} {what}: choose one of {sizes}")


class RowParallelLinear(nn.Module):
    """A linear layer split by its input features: this rank's slice of x times its slice of W is a partial sum
    of the whole output; the all-reduce adds every rank's, so each rank holds the whole output."""

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding table: ids outside them look up zeros here, and the
    all-reduce adds the one rank's row that is not zero."""

    def __init__(self, weight: torch.Tensor, start: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """The output head's rows for this rank's slice of the vocabulary: its logits, then an all-gather of every
    rank's slice (padded to equal sizes, the padding cut off) so each rank holds every logit."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, rank: int, world_size: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.rank, self.world_size, self.group = vocab_size, rank, world_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.local_logits(x).contiguous()
        if local.is_cuda and dist.get_backend(self.group) == "gloo":
            # gloo cannot all-gather GPU tensors: each rank's slice in its place, zeros elsewhere, summed.
            width = local.shape[-1]
            whole = local.new_zeros(*local.shape[:-1], width * self.world_size)
            whole[..., self.rank * width : (self.rank + 1) * width] = local
            dist.all_reduce(whole, group=self.group)
            return whole[..., : self.vocab_size]
        slices = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(slices, local, group=self.group)
        return torch.cat(slices, dim=-1)[..., : self.vocab_size]

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logits (a seam: step 15 multiplies it in one order for every batch)."""
        return F.linear(x, self.weight)


def rows_of(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's 1/size of a weight's output features (a column split of the layer)."""
    return weight.chunk(size, dim=0)[rank].clone()


def columns_of(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's 1/size of a weight's input features (a row split of the layer)."""
    return weight.chunk(size, dim=1)[rank].contiguous().clone()


def split_linear(layer: nn.Linear, rank: int, size: int) -> None:
    """Keep rank's slice of the output features, in place (the bias too)."""
    layer.weight = nn.Parameter(rows_of(layer.weight.data, rank, size), requires_grad=False)
    if layer.bias is not None:
        layer.bias = nn.Parameter(rows_of(layer.bias.data, rank, size), requires_grad=False)
    layer.out_features //= size


def vocab_slice(weight: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, int]:
    """Rank's rows of a [vocab, hidden] table, the last rank's padded with zeros so all are the same size,
    and the first id they hold."""
    per_rank = -(-weight.shape[0] // size)
    start = rank * per_rank
    rows = weight[start : start + per_rank]
    padding = rows.new_zeros(per_rank - rows.shape[0], weight.shape[1])
    return torch.cat([rows, padding]).contiguous(), start


@torch.no_grad()
def shard_layer(layer: DecoderLayer, rank: int, size: int, group: dist.ProcessGroup | None) -> None:
    """Cut one decoder layer down to rank's shard, in place (exercise 04-shard-layer): q, k, v, gate and up by
    columns, o_proj and down_proj by rows, then an all-reduce (`RowParallelLinear`); the attention module
    counts only its own heads."""
    attention, mlp = layer.self_attn, layer.mlp
    for projection in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
        split_linear(projection, rank, size)
    attention.num_heads //= size
    attention.num_kv_heads //= size
    attention.o_proj = RowParallelLinear(columns_of(attention.o_proj.weight.data, rank, size), group)
    mlp.down_proj = RowParallelLinear(columns_of(mlp.down_proj.weight.data, rank, size), group)


@torch.no_grad()
def shard_model(model: CausalLM, rank: int, size: int, group: dist.ProcessGroup | None = None) -> CausalLM:
    """Cut a whole, prepared model down to rank's shard, in place, and return it."""
    config = model.config
    check_divides(config, size)
    if size == 1:
        return model
    for layer in model.model.layers:
        shard_layer(layer, rank, size, group)
    embedding, start = vocab_slice(model.model.embed_tokens.weight.data, rank, size)
    model.model.embed_tokens = VocabParallelEmbedding(embedding, start, group)
    # A tied head is the embedding table: the same slice of it, shared.
    head = (model.model.embed_tokens.weight if config.tie_word_embeddings
            else vocab_slice(model.lm_head.weight.data, rank, size)[0])
    model.lm_head = VocabParallelHead(head, config.vocab_size, rank, size, group)
    # What this rank holds, for the engine: its pool stores its own KV heads only.
    model.config = dataclasses.replace(config, num_heads=config.num_heads // size,
                                       num_kv_heads=config.num_kv_heads // size,
                                       intermediate_size=config.intermediate_size // size)
    return model
