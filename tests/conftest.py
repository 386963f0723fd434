"""Shared fixtures: the embedded model, its transformers oracle, the tokenizer, and the tiny models.

Everything here is session-scoped and read-only: a test must never change a model's weights. Shared plain
functions (reference runs, checks, markers) are in helpers.py.

A test that uses the embedded model (`embedded`, `embedded_hf`, `embedded_reference`) carries
`@pytest.mark.embedded`, so that `pytest -m "not embedded"` runs where only the tokenizer's files are at hand
(the GPU machine); collection fails naming any test that does not.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

# Without a GPU, Triton kernels run only in Triton's interpreter, which must be chosen before triton is
# first imported (by anything), hence here, before torch and transformers.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`make test` runs a worker per core) each worker keeps to one thread, and so does every
# process a test starts (a notebook's kernel, a server, a rank): torch would otherwise give each one a thread
# per core, and the workers would fight over the same cores. Set before torch is imported, which reads it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import PreTrainedModel  # noqa: E402

from common.config import TINY_ARCHES  # noqa: E402
from common.loading import LoadedModel, embedded_tokenizer, load_model  # noqa: E402
from common.reference import hf_model_for  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402
from tests.helpers import PARITY_MAX_TOKENS  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # in case a plugin imported torch before OMP_NUM_THREADS was set above

EMBEDDED_FIXTURES = {"embedded", "embedded_hf", "embedded_reference"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse a test that uses the embedded model without the `embedded` marker: `-m "not embedded"` would
    run it on a machine that has only the tokenizer's files, and it would fail there."""
    unmarked = [item.nodeid for item in items if EMBEDDED_FIXTURES & set(getattr(item, "fixturenames", ()))
                and item.get_closest_marker("embedded") is None]
    if unmarked:
        raise pytest.UsageError("these tests use the embedded model but lack @pytest.mark.embedded: "
                                + ", ".join(unmarked))


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
