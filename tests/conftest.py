"""Shared fixtures: the embedded model, its transformers oracle, the tokenizer, and the tiny models.

Everything here is session-scoped and read-only: a test must never change a model's weights.
"""

from __future__ import annotations

import os

# Without a GPU, Triton kernels run only in Triton's interpreter, which must be chosen before triton is
# first imported (by anything), hence here, before torch and transformers.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import PreTrainedModel  # noqa: E402

from common.config import TINY_ARCHES  # noqa: E402
from common.engine import EngineConfig  # noqa: E402
from common.loading import LoadedModel, embedded_tokenizer, load_model  # noqa: E402
from common.reference import hf_model_for  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402
from step01_serial.engine import SerialEngine  # noqa: E402


def step01_tokens(loaded: LoadedModel, prompts: list[list[int]],
                  params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Step 01's tokens for these prompts on the CPU, each request run alone: what every later step must give."""
    return [c.token_ids for c in SerialEngine(loaded, EngineConfig(device="cpu")).generate(prompts, params)]


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
