"""Step 04, tensor parallel on the CPU: gloo, 2 or 3 processes (as many as the tiny model's KV heads allow). The
final engine's eager path split over the ranks gives one process's tokens, every rank emits the same, and every
rank holds nothing at the end; bad sizes are refused in one line; no process outlives the engine."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from common.checks import staggered_generate
from common.loading import load_model
from common.model import ForwardContext
from common.prompts import PARITY_PROMPTS
from common.sampling import SamplingParams
from common.steps import STEP_NAMES, find_step
from step04_multi_gpu import sharding
from step04_multi_gpu.sharding import TensorParallelConfigError
from step04_multi_gpu.tensor_parallel import Launch, TensorParallelEngine, check_world, free_address, spawn_worker
from tests.helpers import PARITY_MAX_TOKENS, step01_tokens

FINAL = STEP_NAMES[-1]
REPO = Path(__file__).resolve().parents[1]
# Tiny models have 6 query heads; llama and qwen2 3 KV heads, qwen3 2.
SPLITS = [("tiny-qwen3", 2), ("tiny-llama", 3), ("tiny-qwen2", 3)]


def split_engine(model: str, size: int, step: str = FINAL, **config: Any) -> TensorParallelEngine:
    config_class = find_step(step).engine_class().config_class
    settings = {"device": "cpu", "block_size": 4, "num_blocks": 256, "max_num_batched_tokens": 16} | config
    return TensorParallelEngine(step, config_class(model=model, **settings), size)


def assert_ranks_agree_and_hold_nothing(reports: list[dict[str, Any]], size: int) -> None:
    assert [r["rank"] for r in reports] == list(range(size))
    assert len({r["emitted"] for r in reports}) == 1, f"the ranks emitted different tokens: {reports}"
    assert len({r["blocks"] for r in reports}) == 1, "the ranks' pools differ in size"
    for r in reports:
        assert (r["requests"], r["running"], r["waiting"], r["blocks_used"]) == (0, 0, 0, 0), f"rank left: {r}"


class CausalAttention(ForwardContext):
    """Attention over the forward's own tokens only (no cache): enough to run one layer on its own."""

    def __init__(self, tokens: int) -> None:
        self.positions = torch.arange(tokens)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)


@pytest.mark.parametrize("model, size", SPLITS)
def test_a_sharded_layer_sums_to_the_whole_one(model: str, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """No processes: each rank's share of a layer is cut from a copy, and the shares' partial outputs added by
    hand. Attention and MLP each give the whole layer's output, and each calls one all-reduce on its whole
    output (recorded here, not run: with one process there is nobody to add): without it, a rank would go on
    with its partial sum."""
    reduced: list[tuple[int, ...]] = []  # the shape of each tensor handed to an all-reduce
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: reduced.append(tuple(tensor.shape)))
    whole = load_model(model).model
    layer = whole.model.layers[0]
    x = torch.randn(5, whole.config.hidden_size)
    rope = whole.rope.lookup(torch.arange(5), x.dtype)
    shares = [copy.deepcopy(layer) for _ in range(size)]
    for rank, share in enumerate(shares):
        sharding.shard_layer(share, rank, size, None)
        heads = (share.self_attn.num_heads, share.self_attn.num_kv_heads)
        assert heads == (layer.self_attn.num_heads // size, layer.self_attn.num_kv_heads // size), (
            f"rank {rank} of {size} counts (query heads, KV heads) {heads}; the whole layer has "
            f"{(layer.self_attn.num_heads, layer.self_attn.num_kv_heads)}")
    with torch.no_grad():
        for part, run in (("attention", lambda s: s.self_attn(x, CausalAttention(5), rope)), ("MLP", lambda s: s.mlp(x))):
            reduced.clear()
            partial = [run(s) for s in shares]
            assert reduced == [tuple(x.shape)] * size, (
                f"the {part} of {size} ranks' shares called all-reduce on tensors of shapes {reduced}; expected one "
                f"all-reduce of the {tuple(x.shape)} output per rank (a row-parallel o_proj / down_proj)")
            expected = layer.self_attn(x, CausalAttention(5), rope) if part == "attention" else layer.mlp(x)
            torch.testing.assert_close(sum(partial), expected, msg=lambda m, part=part: f"{part}: the ranks' partial "
                                       f"outputs do not add up to the whole layer's\n{m}")


@pytest.mark.parametrize("model, size", SPLITS)
def test_split_over_ranks_gives_one_process_tokens(model: str, size: int) -> None:
    """A token budget of 16, requests joining every 2 steps: step 01's tokens, on every rank alike."""
    tiny = load_model(model)
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:6]]
    params = SamplingParams(max_tokens=16)
    with split_engine(model, size) as engine:
        got = [c.token_ids for c in staggered_generate(engine, prompts, params, arrive_every=2)]
        reports = engine.rank_reports()
        workers = list(engine.workers)
    assert got == step01_tokens(tiny, prompts, params)
    assert_ranks_agree_and_hold_nothing(reports, size)
    assert not any(w.is_alive() for w in workers), "a rank outlived close()"


def test_fp8_weights_over_three_ranks_give_one_processs_fp8_tokens() -> None:
    """Step 17's --quantization fp8 split over ranks: each rank quantizes o and down as one process quantizes the
    whole weight, then keeps its columns, so the ranks give the one-process FP8 engine's tokens. Here those differ
    from the unquantized model's: FP8 is what runs."""
    tiny = load_model("tiny-qwen2")
    prompts = [tiny.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:6]]
    params = SamplingParams(max_tokens=16)
    final = find_step(FINAL).engine_class()

    def alone(quantization: str | None) -> list[list[int]]:
        config = final.config_class(device="cpu", block_size=4, num_blocks=256, quantization=quantization)
        return [c.token_ids for c in final(tiny, config).generate(prompts, params)]

    expected = alone("fp8")
    assert expected != alone(None)
    with split_engine("tiny-qwen2", 3, quantization="fp8") as engine:
        got = [c.token_ids for c in staggered_generate(engine, prompts, params, arrive_every=2)]
        reports = engine.rank_reports()
    assert got == expected
    assert_ranks_agree_and_hold_nothing(reports, 3)


def test_prefix_hits_preemption_and_abort_over_two_ranks() -> None:
    """A pool so small that requests are preempted, prompts that share their start (step 10's cache hits), and
    one request aborted mid-decode: the others keep step 01's tokens, every rank frees everything."""
    tiny = load_model("tiny-qwen3")
    shared = "Read this first, then answer: " + "the quick brown fox jumps over the lazy dog; " * 4
    prompts = [tiny.tokenizer.apply_chat_template(shared + p) for p in PARITY_PROMPTS[:6]]
    params = SamplingParams(max_tokens=24)
    expected = step01_tokens(tiny, prompts, params)
    longest = -(-(max(map(len, prompts)) + 24) // 4)
    with split_engine("tiny-qwen3", 2, num_blocks=longest + 6) as engine:
        ids = [engine.add_request(p, params) for p in prompts]
        requests = [engine.requests[i] for i in ids]
        for _ in range(6):
            engine.step()
        engine.abort(ids[2])
        while engine.has_unfinished():
            engine.step()
        stats = engine.stats()
        reports = engine.rank_reports()
    kept = [r.output_token_ids for i, r in enumerate(requests) if i != 2]
    assert kept == [t for i, t in enumerate(expected) if i != 2]
    assert stats["preemptions_total"] > 0 and stats["prefix_cache_hits_total"] > 0
    assert_ranks_agree_and_hold_nothing(reports, 2)


@pytest.mark.embedded
def test_the_embedded_model_over_three_ranks_matches_hf(embedded_reference: list[tuple[list[int], list[int]]]) -> None:
    """SmolLM2-135M has 9 query heads and 3 KV heads: three ranks of 3 and 1. HF generate()'s greedy tokens."""
    pairs = embedded_reference[:4]
    params = SamplingParams(max_tokens=PARITY_MAX_TOKENS)
    with split_engine("smollm2-135m-instruct", 3, num_blocks=512, max_num_batched_tokens=64) as engine:
        got = [c.token_ids for c in staggered_generate(engine, [p for p, _ in pairs], params, arrive_every=1)]
        reports = engine.rank_reports()
    assert got == [theirs for _, theirs in pairs]
    assert_ranks_agree_and_hold_nothing(reports, 3)


@pytest.mark.parametrize("model, size, step, message", [
    ("tiny-llama", 2, FINAL, "--tensor-parallel-size 2 does not divide the model's 3 KV heads: choose one of 1, 3"),
    ("tiny-qwen3", 4, FINAL, "--tensor-parallel-size 4 does not divide the model's 6 query heads: choose one of 1, 2"),
    ("tiny-qwen3", 2, "step03_vectorized_gather", "splits the engines of steps 06 and later"),
])
def test_a_size_that_does_not_split_the_model_is_refused_before_any_process_starts(
        model: str, size: int, step: str, message: str) -> None:
    with pytest.raises(TensorParallelConfigError, match=message.replace("(", r"\(")):
        TensorParallelEngine(step, find_step(STEP_NAMES[-1]).engine_class().config_class(model=model, device="cpu"),
                             size)


def test_more_ranks_than_gpus_is_refused() -> None:
    import torch

    gpus = torch.cuda.device_count()
    with pytest.raises(TensorParallelConfigError, match=f"needs {gpus + 1} GPUs; this machine has {gpus}"):
        check_world(gpus + 1, "cuda")


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def started(script: list[str], ready: str) -> subprocess.Popen[str]:
    """`script` run from the repository, once it has printed a line containing `ready`."""
    run = subprocess.Popen([sys.executable, *script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert run.stdout is not None
    for line in run.stdout:
        if ready in line:
            return run
    raise AssertionError(f"{script[0]} ended before it printed {ready!r} (exit code {run.wait()})")


def two_ranks_generating() -> subprocess.Popen[str]:
    """run.py on tiny-qwen3 over two ranks, generating for a long while, once both ranks run."""
    return started(["step04_multi_gpu/run.py", "--model", "tiny-qwen3", "--device", "cpu", "--tensor-parallel-size",
                    "2", "--max-tokens", "100000", "--no-check", "--max-model-len", "100000"], "over 2 ranks")


def assert_interrupt_leaves_no_process(run: subprocess.Popen[str]) -> None:
    """Ctrl-C (SIGINT) to `run`: it exits, and every process it started is gone within seconds."""
    children = children_of(run.pid)
    assert children, "no rank process was started"
    time.sleep(1.0)
    run.send_signal(signal.SIGINT)
    run.communicate(timeout=60)
    deadline = time.time() + 30
    while time.time() < deadline and any(Path(f"/proc/{c}").exists() for c in children):
        time.sleep(0.2)
    alive = [c for c in children if Path(f"/proc/{c}").exists() and "Z" not in Path(f"/proc/{c}/stat").read_text().split()[2]]
    assert alive == [], f"processes left behind: {alive}"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes through Linux's /proc")
def test_ctrl_c_leaves_no_process_behind() -> None:
    """run.py over two ranks, interrupted mid-run as Ctrl-C would: it exits, and so does its other rank."""
    assert_interrupt_leaves_no_process(two_ranks_generating())


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes through Linux's /proc")
def test_stopping_the_server_leaves_no_rank_behind() -> None:
    """The server over two ranks, stopped with Ctrl-C: the server exits, and its other rank with it."""
    from step08_serve.launcher import free_port

    server = started(["step08_serve/run.py", "--step", FINAL, "--model", "tiny-qwen3", "--device", "cpu",
                      "--tensor-parallel-size", "2", "--port", str(free_port("127.0.0.1"))], "serving tiny-qwen3")
    assert_interrupt_leaves_no_process(server)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes through Linux's /proc")
def test_a_rank_that_dies_takes_the_others_down_with_a_clear_error() -> None:
    """Rank 1 killed mid-run: rank 0 says which rank died and exits, rather than waiting in an all-reduce."""
    run = two_ranks_generating()
    (worker,) = [pid for pid in children_of(run.pid)  # the rank, not multiprocessing's resource tracker
                 if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    time.sleep(1.0)
    os.kill(worker, signal.SIGKILL)
    rest, _ = run.communicate(timeout=60)
    assert run.returncode == 1
    assert "rank 1 exited with code -9" in rest and "stopping every rank" in rest


def test_a_rank_that_raises_sends_its_traceback_to_rank_0() -> None:
    """A worker whose engine cannot be built (a model that does not exist) exits with code 1, and what rank 0
    says of it (the RankDiedError's message) carries the worker's exception, not just its exit code: a
    worker's stderr is captured by pytest and a notebook, so it would be lost."""
    config = find_step(FINAL).engine_class().config_class(model="no-such-model", device="cpu")
    worker = spawn_worker(Launch(0, 1, "cpu", free_address()), FINAL, config)  # a world of one: joins at once
    worker.process.join(timeout=120)
    report = worker.exit_report()
    assert report is not None, f"the worker did not exit with an error (exit code {worker.process.exitcode})"
    assert report.startswith("rank 0 exited with code 1; its error:"), f"the report names no error: {report}"
    assert "ModelLoadError: unknown model 'no-such-model'" in report, f"the worker's exception is missing: {report}"
    assert "Traceback" in report, f"the worker's traceback is missing: {report}"


def test_step13s_fused_kernels_are_refused_until_they_are_split() -> None:
    config = find_step(FINAL).engine_class().config_class(model="tiny-qwen3", device="cuda")
    with pytest.raises(TensorParallelConfigError, match="not split yet; add --no-fused-ops"):
        TensorParallelEngine(FINAL, config, 2)
