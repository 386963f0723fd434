"""The decode forward with fewer, larger kernels: the model's classes, subclassed, over the same weights.

`fuse(model)` returns a twin of a loaded `CausalLM` whose decoder layers, attention, MLP and the model itself
are the subclasses below; the norms, embedding and linear layers are the very same modules (nothing is
copied: `twin`), so the weights keep their names and every other path (prefill, the eager steps) reads the
same numbers. What the subclasses change, each in its `forward`:

- projections that share an input run as one matrix multiply (`packed_projections.py`), and at up to 16
  rows through our own skinny matrix multiply (`skinny_matmul.py`);
- each element-wise chain is one Triton kernel (`fused_kernels.py`): the RMSNorm, SiLU-and-multiply, and RoPE,
  whose kernel also writes K and V into the cache (`FusedDecodeForward.rotate_and_attend`);
- the kernel that adds a projection to the residual stream also makes the stream ready for the norm that
  reads it next (`PreparedNorm`): the add-and-norm kernel past 16 rows, and up to 16 rows the skinny matrix
  multiply itself, and before the first layer the embedding lookup, so that no norm kernel runs there at
  all. So the residual stream goes from layer to layer as a `PreparedNorm`, not as a bare tensor;
- up to 16 rows, a greedy step's output head returns the tokens from its skinny multiply
  (`FusedCausalLM.greedy_tokens`): no logits are written for another kernel to search.

`pdl` launches every one of these kernels with programmatic dependent launch (`dependent_launch.py`).
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from common.model import Attention, CausalLM, DecoderLayer, MLP, RMSNorm, apply_rope
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import AttentionBackend, AttentionMetadata
from step06_paged_attention.engine import PagedAttentionForward
from step06_paged_attention.triton_kernels import MERGE_IN_KERNEL_MAX_SPLITS
from step12_cuda_graph.mixed_graphs import MixedGraphForward
from step13_fused_decode import fused_kernels
from step13_fused_decode.packed_projections import PackedLinear, PackedProjections, PreparedNorm

Module = TypeVar("Module", bound=nn.Module)


class FusedDecodeForward(PagedAttentionForward):
    """Step 06's paged-attention context, plus RoPE and the KV write in one kernel before the decode kernel."""

    def __init__(self, cache: PagedKVCache, backend: AttentionBackend, meta: AttentionMetadata,
                 positions: torch.Tensor, pdl: bool = False) -> None:
        super().__init__(cache, backend, meta, positions)
        self.pdl = pdl

    def rotate_and_attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.meta.is_prefill:  # the graphs only decode; a prefill would keep step 06's path
            return self.attend(layer_idx, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        # With PDL, the decode kernel is placed while this one still runs only where that was measured to pay
        # (H200, step 13's NOTES.md: the decode-early profiles): a decode kernel that merges its
        # own splits gained about 0.03 ms a step at batch 8; one followed by the merge kernel lost 0.1 ms.
        splits = self.backend.num_splits(q.shape[0], k_cache.shape[2], self.meta.max_seq_len)
        q = fused_kernels.rotate_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, self.meta.slot_mapping,
                                              pdl=self.pdl, decode_early=splits <= MERGE_IN_KERNEL_MAX_SPLITS)
        return self.backend.decode(q, k_cache, v_cache, self.meta)


class FusedMixedForward(MixedGraphForward):
    """Step 12's mixed-step context (the prefill kernel over a tile list, for graphs), with RoPE and the KV write
    in one kernel as in `FusedDecodeForward`: what step 11's verification rows run with."""

    def __init__(self, cache: PagedKVCache, backend: AttentionBackend, meta: AttentionMetadata,
                 positions: torch.Tensor, tile_request: torch.Tensor, tile_index: torch.Tensor,
                 pdl: bool = False) -> None:
        super().__init__(cache, backend, meta, positions, tile_request, tile_index)
        self.pdl = pdl

    def rotate_and_attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.backend.capturable_prefill:
            return self.attend(layer_idx, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        q = fused_kernels.rotate_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, self.meta.slot_mapping,
                                              pdl=self.pdl, decode_early=False)
        return self.backend.prefill_tiles(q, k_cache, v_cache, self.meta, self.tile_request, self.tile_index)


def norm_input(x: PreparedNorm, norm: RMSNorm, pdl: bool) -> tuple[torch.Tensor, PreparedNorm | None]:
    """What a projection of norm(stream) takes: the stream as the kernel that wrote it made it ready for this
    norm, or else norm(stream) from a norm kernel (embeddings that no kernel made ready)."""
    if x.norm is not norm:
        return fused_kernels.rms_norm(x.stream, norm.weight, norm.eps, pdl=pdl), None
    return x.stream, x


class FusedAttention(Attention):
    qkv: PackedLinear
    o: PackedLinear
    pdl: bool

    def forward(self, x: PreparedNorm, norm: RMSNorm, ctx: FusedDecodeForward,
                rope: tuple[torch.Tensor, torch.Tensor]) -> PreparedNorm:
        """The residual stream plus attention over norm(stream), made ready for the norm after it."""
        tokens = x.stream.shape[0]
        q, k, v = self.qkv(*norm_input(x, norm, self.pdl))
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = fused_kernels.rms_norm(q, self.q_norm.weight, self.q_norm.eps, pdl=self.pdl)
            k = fused_kernels.rms_norm(k, self.k_norm.weight, self.k_norm.eps, pdl=self.pdl)
        out = ctx.rotate_and_attend(self.layer_idx, q, k, v, *rope)
        return self.o.add(out.reshape(tokens, self.num_heads * self.head_dim), x.stream)


class FusedMLP(MLP):
    gate_up: PackedLinear
    down: PackedLinear
    pdl: bool

    def forward(self, x: PreparedNorm, norm: RMSNorm) -> PreparedNorm:
        """The residual stream plus the MLP of norm(stream), made ready for the norm after it."""
        gate, up = self.gate_up(*norm_input(x, norm, self.pdl))
        return self.down.add(fused_kernels.silu_mul(gate, up, pdl=self.pdl), x.stream)


class FusedDecoderLayer(DecoderLayer):
    self_attn: FusedAttention
    mlp: FusedMLP

    def forward(self, x: PreparedNorm, ctx: FusedDecodeForward, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> PreparedNorm:
        """The residual stream after this layer; each sublayer reads its norm of it through `norm_input`."""
        x = self.self_attn(x, self.input_layernorm, ctx, rope)
        return self.mlp(x, self.post_attention_layernorm)


class FusedCausalLM(CausalLM):
    """The decode forward of `fuse`: its `forward` returns the residual stream as a `PreparedNorm`, which its
    `compute_logits` and `greedy_tokens` take."""

    packed: PackedProjections
    head: PackedLinear
    pdl: bool

    def forward(self, input_ids: torch.Tensor, ctx: FusedDecodeForward) -> PreparedNorm:
        assert self.rope is not None, "call prepare(device) after loading the weights"
        x = self.embed(input_ids)
        rope = self.rope.lookup(ctx.positions, x.stream.dtype)
        for layer in self.model.layers:
            x = layer(x, ctx, rope)
        return x

    def embed(self, input_ids: torch.Tensor) -> PreparedNorm:
        """The embedding rows, made ready for the first layer's norm as they are looked up, where the skinny
        multiply can take them so (up to 16 rows)."""
        table = self.model.embed_tokens.weight
        if not self.packed.normalises_in_matmul(input_ids.shape[0]):
            return PreparedNorm(self.model.embed_tokens(input_ids), norm=None)
        norm = self.model.layers[0].input_layernorm
        stream, scaled, squares = fused_kernels.embed_for_norm(input_ids, table, norm.weight, self.pdl)
        return PreparedNorm(stream, norm, scaled=scaled, squares=squares)

    def compute_logits(self, hidden: PreparedNorm) -> torch.Tensor:
        (logits,) = self.head(*norm_input(hidden, self.model.norm, self.pdl))
        return logits.float()

    def greedy_tokens(self, hidden: PreparedNorm) -> torch.Tensor:
        """Each row's argmax of the logits, from the head's skinny multiply without writing the logits (up to
        16 rows); in the model's dtype past that (widening to float32 is exact: the same token)."""
        if not self.head.runs_skinny(hidden.stream):
            (logits,) = self.head(*norm_input(hidden, self.model.norm, self.pdl))
            return logits.argmax(dim=-1)
        return self.head.argmax(*norm_input(hidden, self.model.norm, self.pdl))


def twin(module: nn.Module, cls: type[Module], children: dict[str, nn.Module] | None = None, **attributes
         ) -> Module:
    """`module` as an instance of `cls` (a subclass of its class), made without `cls.__init__`: the same
    attributes, parameters and submodules (the same objects, nothing copied), `children` put in place of
    some submodules (in the twin only), and `attributes` added."""
    made = cls.__new__(cls)
    made.__dict__.update(module.__dict__)
    made.__dict__["_modules"] = {**module._modules, **(children or {})}
    made.__dict__.update(attributes)
    return made


def fuse(model: CausalLM, skinny: bool = False, pdl: bool = False,
         projections: type[PackedProjections] = PackedProjections) -> FusedCausalLM:
    """The fused decode forward of `model`, over its very weights. Packing re-points the separate projection
    weights at rows of the packed ones (`projections`), so `model` reads the same memory."""
    packed = projections(model, skinny=skinny, pdl=pdl)
    layers = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        fused_attention = twin(attention, FusedAttention, qkv=packed[attention.q_proj, attention.k_proj,
                                                                     attention.v_proj],
                               o=packed[attention.o_proj,], pdl=pdl)
        fused_mlp = twin(mlp, FusedMLP, gate_up=packed[mlp.gate_proj, mlp.up_proj], down=packed[mlp.down_proj,],
                         pdl=pdl)
        layers.append(twin(layer, FusedDecoderLayer, {"self_attn": fused_attention, "mlp": fused_mlp}))
    body = twin(model.model, type(model.model), {"layers": nn.ModuleList(layers)})
    return twin(model, FusedCausalLM, {"model": body}, packed=packed, head=packed[model.lm_head,], pdl=pdl)
