"""Shared fixtures: the embedded model, its transformers oracle, the tokenizer, and the tiny models.

Everything here is session-scoped and read-only: a test must never change a model's weights.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

# Without a GPU, Triton kernels run only in Triton's interpreter, which must be chosen before triton is
# first imported (by anything), hence here, before torch and transformers.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import PreTrainedModel  # noqa: E402

from common.config import TINY_ARCHES, tiny_config  # noqa: E402
from common.engine import EngineConfig  # noqa: E402
from common.loading import LoadedModel, embedded_tokenizer, load_model, random_model  # noqa: E402
from common.reference import hf_model_for  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402
from step01_serial.engine import SerialEngine  # noqa: E402


def step01_tokens(loaded: LoadedModel, prompts: list[list[int]],
                  params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Step 01's tokens for these prompts on the CPU, each request run alone: what every later step must give."""
    return [c.token_ids for c in SerialEngine(loaded, EngineConfig(device="cpu")).generate(prompts, params)]


# The tiny models keep the tokenizer's whole vocabulary (49152), so their output head is by far their largest
# weight. Triton's interpreter runs a skinny matrix multiply one program per band of 32 output columns, one
# after another: 1536 programs for that head, about 8 s of every decode step. 1000 columns make 32 bands, the
# last one of 8 (uneven, as the whole vocabulary's is not), and leave every other shape of the tiny model as is.
SMALL_VOCAB = 1000


def tiny_with_small_vocab(name: str, device: str | torch.device = "cpu", vocab_size: int = SMALL_VOCAB) -> LoadedModel:
    """`load_model(name)` for a tiny model ("tiny-llama", ...), with only `vocab_size` rows in its embedding
    and output head; seeded random weights, the embedded tokenizer (each id below `vocab_size` is one of its
    tokens). Prompts must be brought into the vocabulary first: `in_vocab`."""
    config = dataclasses.replace(tiny_config(name.removeprefix("tiny-")), vocab_size=vocab_size)
    return LoadedModel(name, random_model(config, torch.device(device), torch.float32), embedded_tokenizer(), None)


def in_vocab(prompt_ids: list[int], vocab_size: int = SMALL_VOCAB) -> list[int]:
    """A prompt's ids folded into a small vocabulary (random weights care for no meaning, only for ids)."""
    return [t % vocab_size for t in prompt_ids]


@pytest.fixture(autouse=True)
def release_gpu_memory() -> Iterator[None]:
    """After each test on a GPU machine, collect what it left. An engine built without `num_blocks` sizes its
    KV pool from the GPU's free memory; engines hold reference cycles, so one left for the garbage collector
    could keep ~120 GiB and make the next test's engine run out of memory (seen on the H200)."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """The real SmolLM2-135M-Instruct, float32 on the CPU, loaded once per session."""
    return load_model("smollm2-135m-instruct", device="cpu")


@pytest.fixture(scope="session")
def embedded_hf(embedded: LoadedModel) -> PreTrainedModel:
    """transformers' own model, loaded by transformers from the same checkpoint folder."""
    return hf_model_for(embedded)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The embedded model's tokenizer (also the tiny models' tokenizer)."""
    return embedded_tokenizer()


@pytest.fixture(scope="session", params=[f"tiny-{arch}" for arch in TINY_ARCHES])
def tiny(request: pytest.FixtureRequest) -> LoadedModel:
    """Each tiny seeded-random model in turn: tiny-llama, tiny-qwen2, tiny-qwen3."""
    return load_model(request.param, device="cpu")


PARITY_MAX_TOKENS = 24


def assert_matches_reference(hf: PreTrainedModel, reference: list[tuple[list[int], list[int]]],
                             outputs: list[list[int]]) -> None:
    """Each output is HF's greedy continuation of its prompt, or differs only at a near-tie (measured under HF),
    and at most one of them differs at all."""
    from common.reference import compare_greedy

    identical = 0
    for (prompt, theirs), ours in zip(reference, outputs, strict=True):
        report = compare_greedy(hf, prompt, ours, theirs)
        assert report.ok, report.describe()
        identical += report.equal
    assert identical >= len(reference) - 1


@pytest.fixture(scope="session")
def embedded_reference(embedded: LoadedModel, embedded_hf: PreTrainedModel) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, HF generate() greedy ids) for every parity prompt on the embedded model, computed once."""
    from common.prompts import PARITY_PROMPTS
    from common.reference import reference_greedy

    eos = embedded.tokenizer.eos_token_ids
    pairs = []
    for prompt in PARITY_PROMPTS:
        ids = embedded.tokenizer.apply_chat_template(prompt)
        pairs.append((ids, reference_greedy(embedded_hf, ids, PARITY_MAX_TOKENS, eos)))
    return pairs


def assert_blocks_held_once_per_holder(engine: Any) -> None:
    """Every block in a block table is owned by the allocator, and held once per holder: by one request
    before step 10, by as many requests as its reference count from step 10 on (a shared cached prefix)."""
    held = Counter(b for table in engine.block_tables.values() for b in table)
    ref_counts = getattr(engine.allocator, "ref_counts", None)
    if ref_counts is None:
        assert all(n == 1 for n in held.values()), "a block is in two block tables"
    else:
        assert held == ref_counts, "a block's reference count is not the number of block tables holding it"
    assert set(held) == engine.allocator.owned
