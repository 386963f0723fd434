"""Our own compact decoder for the Llama family (Llama/SmolLM2, Qwen2/2.5, Qwen3).

The model works on a flat batch of tokens: `input_ids` and `positions` are 1-D, one entry per token, however
many requests those tokens belong to. Everything that depends on how tokens are grouped into requests, and
where their keys and values live, is the job of the `ForwardContext` that the engine builds once per forward
and that each attention layer calls. This is what lets every step of the tutorial reuse this file unchanged:
a step changes the KV cache and the context, never the model.

Module and parameter names follow Hugging Face's, so a `model.safetensors` loads without renaming.
No layer forces a device-to-host sync: there is no `.item()`, `.tolist()` or tensor truth test below.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from common.config import ModelConfig


class ForwardContext(ABC):
    """What one forward pass needs besides token ids: positions and access to the KV cache.

    A step subclasses this with its own cache layout. Host-side scalars (lengths, offsets) are plain ints,
    computed once by the engine, so the layers never have to ask the device for them.
    """

    positions: torch.Tensor  # [num_tokens], int64, on the model's device

    @abstractmethod
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this forward's k/v for `layer_idx` and return attention output.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim].
        """


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference, then scale in the model's dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding:
    """Precomputed cos/sin tables for every position, indexed by each token's position."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        half = config.head_dim // 2
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, half, dtype=torch.int64, device=device).float() / half)
        )
        positions = torch.arange(config.max_position_embeddings, device=device).float()
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim]
        self.cos = angles.cos()
        self.sin = angles.sin()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [tokens, 1, head_dim]: looked up once per forward, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [tokens, heads, head_dim] by the angles of each token's position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, q_size, kv_size = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=False)
        if config.qk_norm:  # Qwen3 normalises each head of q and k before RoPE
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, ctx: ForwardContext, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention over x (already normalised): project, rotate, attend through `ctx`, project back."""
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, k, *rope)
        out = ctx.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q and k (a method: a later step computes it in a kernel of its own)."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP: down(silu(gate(x)) * up(x))."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The residual stream x after this layer: each sublayer reads its norm of x and adds its output to x."""
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """Named `model` inside `CausalLM`, as in Hugging Face checkpoints (`model.layers.0...`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None  # built on the right device by `prepare`

    def prepare(self, device: torch.device | str) -> CausalLM:
        """Tie the head if the checkpoint does and build the RoPE tables; call once after the weights exist."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(self.config, device)
        self.eval().requires_grad_(False)
        return self

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The residual stream after the last layer, one row per input token: [num_tokens, hidden_size]. The
        final norm is applied by `compute_logits`, to the rows sampled from."""
        assert self.rope is not None, "call prepare(device) after loading the weights"
        x = self.model.embed_tokens(input_ids)
        rope = self.rope.lookup(ctx.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, ctx, rope)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the rows we sample from (usually each request's last token only)."""
        return self.lm_head(self.model.norm(hidden)).float()
