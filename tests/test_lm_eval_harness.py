"""A real evaluation client that no one here wrote scores the server: lm-evaluation-harness's
`local-completions` model runs a small multiple-choice task (tests/data/lm_eval_task) against step08_serve, and
every choice's log-likelihood equals the one the same harness's `hf` backend computes with transformers on the
same checkpoint, within 1e-3, with the same is_greedy flag.

For each (question, choice) lm-eval sends POST /v1/completions with `prompt` a list of token-id lists (the
question's ids then the choice's, tokenized by lm-eval with the model's own tokenizer), `echo: true`,
`logprobs: 1`, `max_tokens: 1`, `temperature: 0` and `seed`, and reads only `choices[i].index`,
`choices[i].logprobs.token_logprobs` and `.top_logprobs`: it counts the question's tokens off the front, drops
the last entry (the one generated token), sums what is left and calls it greedy when each token's log-probability
is the largest in its `top_logprobs`. So the server must echo the prompt's ids as sent, then exactly one
generated token, even when that token ends the text.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.loading import LoadedModel
from step08_serve.api_server import create_app
from step08_serve.async_engine import AsyncEngine
from step08_serve.launcher import running_server
from step10_prefix_caching.engine import PrefixCachingEngine, PrefixCachingEngineConfig

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[test]' (it is a test extra)")

os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
TASK_DIR = Path(__file__).parent / "data" / "lm_eval_task"
TASK = "llm_steps_tiny_mc"
SERVED = "smollm2-135m-instruct"
TOLERANCE = 1e-3


def evaluate(model: str, model_args: dict) -> list[dict]:
    """lm-eval's own evaluation of the task with `model`: its samples in document order, each with `resps`."""
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], log_samples=True, bootstrap_iters=0,
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False))
    return sorted(results["samples"][TASK], key=lambda s: s["doc_id"])


def choice_scores(samples: list[dict]) -> list[list[tuple[float, bool]]]:
    """Per document, per choice: (log-likelihood of the choice after the question, is_greedy)."""
    return [[(float(ll), bool(greedy)) for ll, greedy in s["filtered_resps"]] for s in samples]


@pytest.fixture()
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hub: both sides read the checkpoint folder and the task's file, and nothing may try the network.
    The libraries read these variables when imported, so their settings are patched as well."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(TASK_DIR)  # the task's data_files are relative


@pytest.mark.embedded
def test_lm_eval_local_completions_scores_equal_its_hf_backend(
        embedded: LoadedModel, offline: None, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint = str(embedded.source_dir)
    hf = evaluate("hf", {"pretrained": checkpoint, "dtype": "float32", "device": "cpu", "batch_size": 8})
    expected = choice_scores(hf)
    assert len(hf) == len((TASK_DIR / "questions.jsonl").read_text().splitlines())
    assert [len(doc) for doc in expected] == [len(s["doc"]["choices"]) for s in hf]
    assert any(greedy for doc in expected for _, greedy in doc), "no greedy choice: the flags would go untested"

    # The server's default engine on a CPU (step 10), small blocks so that prompts share cached prefixes.
    engine = PrefixCachingEngine(embedded, PrefixCachingEngineConfig(device="cpu", block_size=4, num_blocks=512))
    with running_server(create_app(AsyncEngine(engine), SERVED, SERVED)) as url:
        api_args = {
            "model": SERVED,  # sent as `model`
            "base_url": f"{url}/v1/completions",  # lm-eval posts to this URL as it is
            "tokenizer_backend": "huggingface",  # "auto" would probe the server; tiktoken would download
            "tokenizer": checkpoint,
            "tokenized_requests": True,  # prompts as token ids: the same ids the hf backend scores
            "batch_size": 4,  # several prompts of different lengths in one request
            "num_concurrent": 2,  # and two requests at once
            "max_retries": 1,  # a refusal fails at once instead of after back-offs
            "max_length": 2048,
        }
        try:
            served = evaluate("local-completions", api_args)
        except Exception as err:  # noqa: BLE001 - lm-eval raises aiohttp's error, without the server's answer
            answers = [r.getMessage() for r in caplog.records if "API request failed" in r.getMessage()]
            pytest.fail(f"lm-eval's local-completions failed against the server: {type(err).__name__}: {err}; "
                        f"{answers[-1] if answers else 'no answer logged'}")

    assert [s["doc_id"] for s in served] == [s["doc_id"] for s in hf]
    assert [s["arguments"] for s in served] == [s["arguments"] for s in hf]  # the same (question, choice) pairs
    got = choice_scores(served)
    assert [len(doc) for doc in got] == [len(doc) for doc in expected]
    for sample, want, have in zip(hf, expected, got, strict=True):
        for choice, (ll_want, greedy_want), (ll_have, greedy_have) in zip(
                sample["doc"]["choices"], want, have, strict=True):
            where = f"{sample['doc']['question']!r} / {choice!r}"
            assert abs(ll_have - ll_want) <= TOLERANCE, f"{where}: server {ll_have}, hf {ll_want}"
            assert greedy_have == greedy_want, f"{where}: is_greedy server {greedy_have}, hf {greedy_want}"

