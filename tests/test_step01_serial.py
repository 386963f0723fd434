"""step01_serial: greedy parity with HF generate(), the run.py contract, bad input, and cleanup."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.checks import check_against_reference, staggered_generate
from common.engine import EngineConfig
from common.prompts import DEMO_PROMPTS, PARITY_PROMPTS
from common.reference import compare_greedy
from common.request import FinishReason
from common.sampling import SamplingParams
from step01_serial.engine import SerialEngine
from step01_serial.run import __doc__ as RUN_DOC
from tests.helpers import PARITY_MAX_TOKENS

REPO = Path(__file__).resolve().parent.parent


def run_cli(*argv: str) -> int:
    from common.cli import main

    return main("step01_serial", RUN_DOC, list(argv))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_hf_with_staggered_arrivals(arch: str) -> None:
    """Requests that join while others decode still produce exactly HF's greedy tokens."""
    engine = SerialEngine.from_config(EngineConfig(model=f"tiny-{arch}", device="cpu"))
    prompts = [engine.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:6]]
    completions = staggered_generate(engine, prompts, SamplingParams(max_tokens=10), arrive_every=1)
    reports = check_against_reference(engine, prompts, completions, max_tokens=10)
    for i, report in enumerate(reports):
        assert report.equal, f"{arch}, request {i} (joined at step {i}): not HF's tokens: {report.describe()}"
    lengths = [len(c.token_ids) for c in completions]
    assert lengths == [10] * len(prompts), f"expected 10 tokens per request (max_tokens), got {lengths}"
    assert not engine.requests, f"{len(engine.requests)} requests still held after every one finished"
    assert engine.kv_tokens_reserved > 0, "no KV cache was counted as reserved"


@pytest.mark.embedded
def test_embedded_parity_through_prompts_file(tmp_path: Path, embedded, embedded_hf, embedded_reference) -> None:
    """The issue's test of record: 12 prompts (English, CJK, emoji, code) through --prompts-file and
    --output-json are token-identical to HF generate() on the embedded model, or differ only at a shown tie.
    HF's tokens are `embedded_reference`'s (the same prompts, token count and EOS, generated once a session)."""
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(p.replace("\n", "\\n") for p in PARITY_PROMPTS) + "\n", encoding="utf-8")
    out = tmp_path / "out.json"
    max_tokens = PARITY_MAX_TOKENS
    code = run_cli("--prompts-file", str(prompts_file), "--output-json", str(out),
                   "--max-tokens", str(max_tokens), "--no-check")
    assert code == 0
    rows = json.loads(out.read_text(encoding="utf-8"))
    assert [r["prompt"] for r in rows] == PARITY_PROMPTS
    from common.loading import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    assert tokenizer.eos_token_ids == embedded.tokenizer.eos_token_ids  # the EOS HF's tokens stopped at
    identical = 0
    for row, (reference_ids, theirs) in zip(rows, embedded_reference, strict=True):
        prompt_ids = tokenizer.apply_chat_template(row["prompt"])
        assert prompt_ids == reference_ids  # HF's tokens below continue this very prompt
        report = compare_greedy(embedded_hf, prompt_ids, row["token_ids"], theirs)
        assert report.ok, f"{row['prompt']!r}: {report.describe()}"
        identical += report.equal
        assert row["text"] == tokenizer.decode(row["token_ids"])
        assert "\ufffd" not in row["text"]
        assert row["finish_reason"] in ("stop", "length")
    assert identical >= len(rows) - 1  # near-ties are rare; more than one would need a look


def test_dry_run_passes() -> None:
    assert run_cli("--dry-run", "--max-tokens", "6") == 0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--model", "/definitely/not/here/model"], "does not exist"),
        (["--model", "random:gpt-5"], "choose one of"),
        (["--model", "tiny-llama", "--max-model-len", "8"], "shorten the prompt"),
        (["--model", "tiny-llama", "--prompts-file", "/no/such/file.txt"], "does not exist"),
    ],
)
def test_bad_input_is_one_clear_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(*argv, "--max-tokens", "2") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and expected in err
    assert len(err.splitlines()) == 1


def test_unsupported_architecture_exits_nonzero(tmp_path: Path) -> None:
    """A real process, a real exit code: a GPT-2 folder is refused with the supported list."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    proc = subprocess.run(
        [sys.executable, str(REPO / "step01_serial" / "run.py"), "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "unsupported architecture GPT2LMHeadModel" in proc.stderr
    assert "LlamaForCausalLM" in proc.stderr


def test_abort_frees_everything() -> None:
    engine = SerialEngine.from_config(EngineConfig(model="tiny-llama", device="cpu"))
    ids = [engine.add_request(p, SamplingParams(max_tokens=50)) for p in DEMO_PROMPTS]
    engine.step()
    engine.step()
    requests = [engine.requests[rid] for rid in ids]
    assert all(r.cache is not None for r in requests)
    out = engine.abort(ids[1])
    assert out is not None and out.finished and out.finish_reason is FinishReason.ABORT
    assert requests[1].cache is None and ids[1] not in engine.requests
    waiting = engine.add_request("still queued", SamplingParams(max_tokens=5))
    engine.abort(waiting)
    while engine.has_unfinished():
        engine.step()
    assert all(r.cache is None for r in requests) and not engine.requests and not engine.running and not engine.waiting
    assert engine.abort("unknown-id") is None


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    """The same seed gives the same sample alone or in company; different seeds differ."""
    engine = SerialEngine.from_config(EngineConfig(model="tiny-qwen2", device="cpu"))
    prompt = engine.tokenizer.apply_chat_template("Tell me a story")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=123)
    alone = engine.generate([prompt], params)[0].token_ids
    crowd = engine.generate([prompt, prompt, prompt],
                            [SamplingParams(max_tokens=12, temperature=1.0, seed=7), params,
                             SamplingParams(max_tokens=12, temperature=1.0, seed=8)])
    assert crowd[1].token_ids == alone
    assert crowd[0].token_ids != crowd[2].token_ids
    greedy = engine.generate([prompt], SamplingParams(max_tokens=12))[0].token_ids
    assert alone != greedy  # sampling at temperature 1 really samples


def test_request_ids_and_empty_prompts_are_checked() -> None:
    engine = SerialEngine.from_config(EngineConfig(model="tiny-llama", device="cpu"))
    engine.add_request([1, 2, 3], request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2, 3], request_id="a")
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([10**9])


def test_contiguous_reservation_is_measured() -> None:
    """step01 reserves prompt + max_tokens per request; what early-stopping requests leave unused is counted."""
    engine = SerialEngine.from_config(EngineConfig(model="tiny-llama", device="cpu"))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    params = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, stop_token_ids=list(range(49152)))]
    completions = engine.generate(prompts, params)
    lengths = [len(c.token_ids) for c in completions]
    assert lengths == [20, 1], f"tokens per request {lengths}, expected [20, 1] (the second stops at its first)"
    reserved = engine.kv_tokens_reserved
    assert reserved == (3 + 20) + (5 + 20), f"{reserved} KV slots reserved, expected prompt + max_tokens each: 48"
    # Every token but the last sampled one went through a forward and so into the cache.
    used = engine.kv_tokens_used
    assert used == (3 + 20 - 1) + (5 + 1 - 1), f"{used} KV slots filled, expected 22 + 5 = 27"
    report = engine.memory_report()
    assert "48 token slots reserved" in report and "27 filled" in report, f"the memory report says: {report}"
