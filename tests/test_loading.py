"""Loading: one clear error per mistake (naming what is wrong and what to do), and faithful round-trips."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from common.config import SUPPORTED_ARCHITECTURES, UnsupportedModelError, bundled_config_names
from common.engine import EngineConfig, PromptTooLongError
from common.loading import LoadedModel, ModelLoadError, embedded_tokenizer_dir, load_model
from common.reference import hf_model_for, reference_logits
from common.request import FinishReason
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from step01_serial.engine import SerialEngine
from step01_serial.kv_cache import ContiguousForward, ContiguousKVCache

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_checkpoint(folder: Path, loaded: LoadedModel, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A Hugging Face style folder: config.json, model.safetensors, and the embedded tokenizer's files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(loaded.model.config.to_hf()))
    if tensors is None:
        tensors = checkpoint_tensors(loaded)
    save_file(tensors, str(folder / "model.safetensors"))
    for name in _TOKENIZER_FILES:
        shutil.copy(embedded_tokenizer_dir() / name, folder / name)
    return folder


def checkpoint_tensors(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """The state dict as a checkpoint stores it: a tied head is not written twice."""
    state = {name: t.detach().clone().contiguous() for name, t in loaded.model.state_dict().items()}
    if loaded.model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


@torch.inference_mode()
def prefill_logits(loaded: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    model = loaded.model
    cache = ContiguousKVCache(model.config, len(token_ids), model.device, model.dtype)
    ctx = ContiguousForward(cache, 0, len(token_ids), model.device)
    return model.compute_logits(model(torch.tensor(token_ids), ctx))


def test_unknown_model_name_lists_the_choices() -> None:
    """A name that is no folder, no hub id and no built-in says so and lists what is accepted."""
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'") as err:
        load_model("no-such-model")
    message = str(err.value)
    for choice in ("smollm2-135m-instruct", "tiny-llama", "tiny-qwen3", "random:qwen2.5-7b", "local folder"):
        assert choice in message


def test_missing_folder_says_it_does_not_exist(tmp_path: Path) -> None:
    """A path-like name that does not exist is reported as a missing folder, not sent to the hub."""
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ModelLoadError, match=re.escape(f"model folder {missing} does not exist: check the path")):
        load_model(str(missing))


def test_folder_without_config_is_not_a_model(tmp_path: Path) -> None:
    """An existing folder (or file) without config.json is refused, saying what a model folder holds."""
    with pytest.raises(ModelLoadError, match="not a model folder.*config.json"):
        load_model(str(tmp_path))
    stray = tmp_path / "weights.bin"
    stray.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="not a model folder"):
        load_model(str(stray))


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    """A GPT-2 config.json is refused naming GPT2LMHeadModel and every architecture we do run."""
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    message = str(err.value)
    assert "GPT2LMHeadModel" in message
    for name in SUPPORTED_ARCHITECTURES:
        assert name in message


def test_rope_scaling_is_refused(tmp_path: Path) -> None:
    """A config with RoPE scaling (which we do not implement) is refused rather than run inexactly."""
    config = load_model("tiny-llama").model.config.to_hf()
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    config.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="RoPE scaling 'llama3'"):
        load_model(str(tmp_path))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    """A checkpoint lacking one tensor fails naming that tensor."""
    loaded = load_model("tiny-qwen2")
    tensors = checkpoint_tensors(loaded)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    folder = write_checkpoint(tmp_path / "ckpt", loaded, tensors)
    with pytest.raises(ModelLoadError, match=r"missing weights.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(folder))


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    """A checkpoint with a tensor our model does not have fails naming that tensor."""
    loaded = load_model("tiny-llama")
    tensors = checkpoint_tensors(loaded)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # Qwen3-only, not in a Llama
    folder = write_checkpoint(tmp_path / "ckpt", loaded, tensors)
    with pytest.raises(ModelLoadError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        load_model(str(folder))


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    """A tensor of the wrong shape fails naming the tensor and both shapes."""
    loaded = load_model("tiny-llama")
    tensors = checkpoint_tensors(loaded)
    tensors["model.norm.weight"] = torch.ones(95)
    folder = write_checkpoint(tmp_path / "ckpt", loaded, tensors)
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight' has shape \(95,\), expected \(96,\)"):
        load_model(str(folder))


def test_folder_without_safetensors_says_so(tmp_path: Path) -> None:
    """A model folder with config and tokenizer but no weights says that the *.safetensors are missing."""
    folder = write_checkpoint(tmp_path / "ckpt", load_model("tiny-llama"))
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(folder))


def test_unknown_random_config_lists_the_choices() -> None:
    """random:<name> with an unknown name lists every bundled config."""
    with pytest.raises(ModelLoadError, match="no bundled config 'gpt-5'") as err:
        load_model("random:gpt-5")
    names = bundled_config_names()
    assert {"qwen2.5-7b", "qwen3-0.6b"} <= set(names)
    for name in names:
        assert name in str(err.value)


def test_unknown_tiny_arch_lists_the_choices() -> None:
    """tiny-<arch> with an unknown architecture is a ValueError naming the ones that exist."""
    with pytest.raises(UnsupportedModelError, match="tiny model for 'gpt2'.*llama, qwen2, qwen3"):
        load_model("tiny-gpt2")


def test_tiny_models_are_deterministic_per_seed() -> None:
    """The same seed gives bit-identical weights; another seed gives different ones."""
    a = load_model("tiny-qwen3", seed=0).model.state_dict()
    b = load_model("tiny-qwen3", seed=0).model.state_dict()
    c = load_model("tiny-qwen3", seed=1).model.state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)


def test_local_folder_round_trip(tmp_path: Path, tiny: LoadedModel, tokenizer: Tokenizer) -> None:
    """Saving a tiny model as a folder and loading it back gives the same config, weights and logits."""
    folder = write_checkpoint(tmp_path / "ckpt", tiny)
    loaded = load_model(str(folder))
    assert loaded.source_dir == folder
    assert loaded.model.config == tiny.model.config
    tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert tied == tiny.model.config.tie_word_embeddings
    ids = tokenizer.encode("Round trip: 你好 🌍")
    assert loaded.tokenizer.encode("Round trip: 你好 🌍") == ids
    assert torch.equal(prefill_logits(loaded, ids), prefill_logits(tiny, ids))


def test_engine_rejects_an_over_long_prompt() -> None:
    """A prompt that fills the context is refused at add_request, naming both lengths; one token less runs."""
    engine = SerialEngine.from_config(EngineConfig(model="tiny-llama", device="cpu", max_model_len=32))
    with pytest.raises(PromptTooLongError, match="prompt has 32 tokens but the context holds 32") as err:
        engine.add_request(list(range(100, 132)))
    assert "shorten the prompt" in str(err.value)
    assert not engine.has_unfinished()  # nothing half-registered
    completion = engine.generate([list(range(100, 131))], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(completion.token_ids) == 1 and completion.finish_reason is FinishReason.LENGTH


def test_engine_rejects_empty_and_out_of_vocab_prompts() -> None:
    """An empty prompt and a token id outside the vocabulary are ValueErrors that say what is wrong."""
    engine = SerialEngine.from_config(EngineConfig(model="tiny-llama", device="cpu", max_model_len=32))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"token id 49152 is outside the vocabulary \[0, 49152\)"):
        engine.add_request([5, 49152])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_folder_without_tokenizer_files_says_so(tmp_path: Path, arch: str) -> None:
    """A folder with config and weights but no tokenizer files must fail clearly at load time.

    Without the check, tiny-qwen2's folder loaded with an empty 1-token tokenizer (encode() returned [], so
    every prompt later failed as "empty"), and tiny-llama's raised transformers' error about sentencepiece.
    """
    folder = write_checkpoint(tmp_path / "ckpt", load_model(f"tiny-{arch}"))
    for name in _TOKENIZER_FILES:
        (folder / name).unlink()
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(str(folder))


@pytest.mark.parametrize(
    "config_text",
    ["{not json", json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 10})],
    ids=["malformed", "missing-keys"],
)
def test_broken_config_json_names_the_file(tmp_path: Path, config_text: str) -> None:
    """Malformed or incomplete config.json must give a ModelLoadError naming the folder, not a bare
    JSONDecodeError / KeyError('num_attention_heads')."""
    (tmp_path / "config.json").write_text(config_text)
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path))):
        load_model(str(tmp_path))


def test_a_written_random_checkpoint_loads_as_the_same_weights(tmp_path: Path) -> None:
    """scripts/write_random_checkpoint.py: the folder (sharded, with its index) holds the weights `tiny-qwen2` is
    generated with, and loads here and in transformers alike."""
    from scripts.write_random_checkpoint import write_checkpoint

    shards = write_checkpoint("tiny-qwen2", tmp_path, torch.device("cpu"), torch.float32, shard_bytes=2**20)
    assert len(shards) > 1  # sharded: the index must name each tensor's file
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    ours, written = load_model("tiny-qwen2"), load_model(str(tmp_path))
    for (name, a), (_, b) in zip(ours.model.state_dict().items(), written.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 300, 2024]])
    assert torch.allclose(hf(ids).logits, reference_logits(hf_model_for(ours), ids[0].tolist())[None], atol=1e-5)
