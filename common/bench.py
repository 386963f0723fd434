"""The benchmark harness: workloads, timing as a client sees it, and JSON evidence.

Measured, never estimated: TTFT is the wall time from a request's arrival to the step that returned its
first token; TPOT is (latency - TTFT) / (output tokens - 1); throughput is output tokens over the wall time
of the whole run. Every result file records what produced it (commit, versions, device, model, workload).

Benchmarks write under runs/ unless given an output path: runs/ is ignored by git, so measuring never
overwrites the committed evidence under results/, and a run never overwrites an earlier one's file there (the
second gets a numbered name). An explicit `--output` (`--bench-output` for a step's run.py) writes exactly
there, results/ included, replacing what was there.
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from common.engine import Engine
from common.sampling import SamplingParams

# Token ids that are ordinary text pieces in every bundled tokenizer's range: synthetic prompts draw
# from here so the same ids are valid for the embedded, tiny and random:* models alike.
_PROMPT_ID_RANGE = (1000, 40000)

# Where a benchmark's evidence goes by default, relative to the folder it runs from (the repository root, as in
# every README): ignored by git, unlike results/, the committed evidence the READMEs cite.
RUNS_DIR = Path("runs")


def default_output(folder: str, *name: str) -> Path:
    """Where a benchmark writes unless given an output path: runs/<folder>/<name>.json, the name being the parts
    joined by "-", with a model id made safe for a file name. default_output("compare", "cpu", "random:qwen2.5-7b")
    is runs/compare/cpu-random-qwen2.5-7b.json: the sub-path that committed evidence has under results/. If an
    earlier run left that file, the first free one of <name>-2.json, <name>-3.json, ...: a second run with the
    same settings keeps the first one's evidence."""
    stem = "-".join(part.replace(":", "-").replace("/", "-") for part in name)
    path = RUNS_DIR / folder / f"{stem}.json"
    number = 2
    while path.exists():
        path = RUNS_DIR / folder / f"{stem}-{number}.json"
        number += 1
    return path


@dataclass
class Workload:
    """Requests that all arrive at once: their prompt ids and how many tokens each must generate."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    def describe(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {
            "name": self.name,
            "num_requests": len(self.prompts),
            "prompt_tokens": {"min": min(lens), "max": max(lens), "total": sum(lens)},
            "output_tokens": {"min": min(self.output_lens), "max": max(self.output_lens), "total": sum(self.output_lens)},
            "ignore_eos": True,
        }


def fixed_workload(batch: int, prompt_len: int = 32, output_len: int = 128, seed: int = 0) -> Workload:
    """The standard workload: `batch` prompts of `prompt_len` tokens, `output_len` new tokens each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(*_PROMPT_ID_RANGE) for _ in range(prompt_len)] for _ in range(batch)]
    return Workload(f"batch{batch}_in{prompt_len}_out{output_len}", prompts, [output_len] * batch)


def nanovllm_workload(num_seqs: int = 256, min_len: int = 100, max_len: int = 1024, seed: int = 0) -> Workload:
    """A large offline workload: input and output lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(*_PROMPT_ID_RANGE) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    outputs = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return Workload(f"nanovllm_{num_seqs}seqs_{min_len}-{max_len}", prompts, outputs)


@dataclass
class RunMetrics:
    system: str  # what ran: a step's engine or "hf-generate"
    workload: str
    batch: int
    output_tokens: int
    elapsed_s: float
    output_tok_per_s: float
    ttft_ms_median: float
    tpot_ms_median: float
    peak_memory_mb: float
    peak_memory_kind: str  # "cuda_allocated" or "process_rss" (the whole process, weights included)
    extra: dict[str, Any] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process_rss"


def _metrics(
    system: str, workload: Workload, start: float, end: float, first: list[float], done: list[float],
    device: torch.device, extra: dict[str, Any] | None = None,
) -> RunMetrics:
    total = sum(workload.output_lens)
    ttft = [(f - start) * 1e3 for f in first]
    tpot = [(d - f) * 1e3 / (n - 1) for f, d, n in zip(first, done, workload.output_lens) if n > 1]
    peak, kind = _peak_memory(device)
    return RunMetrics(
        system, workload.name, len(workload.prompts), total, end - start, total / (end - start),
        statistics.median(ttft), statistics.median(tpot) if tpot else 0.0, peak, kind, extra or {},
    )


def run_engine(engine: Engine, workload: Workload, system: str,
               sampling: dict[str, Any] | Sequence[dict[str, Any]] | None = None) -> RunMetrics:
    """Submit every request at once and step until all finish, timing each request's first and last token.
    `sampling`: further SamplingParams fields every request sets (penalties, logprobs, ...), or a list of them,
    one per request."""
    device = engine.device
    per_request = sampling if isinstance(sampling, Sequence) else [sampling or {}] * len(workload.prompts)
    _reset_peak(device)
    _sync(device)
    start = time.perf_counter()
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, **fields))
        for p, n, fields in zip(workload.prompts, workload.output_lens, per_request, strict=True)
    ]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while engine.has_unfinished():
        outputs = engine.step()  # returns after the step's tokens reached the host: they are real
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    end = time.perf_counter()
    return _metrics(system, workload, start, end, [first[i] for i in ids], [done[i] for i in ids], device)


class _TokenClock(BaseStreamer):
    """Records when generate() produced its first and last new token (put() is first called with the prompt)."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_hf_generate(hf: PreTrainedModel, workload: Workload, pad_token_id: int,
                    cache_implementation: str | None = None) -> RunMetrics:
    """HF generate() on the whole batch at once (left-padded), greedy, forced to the workload's lengths.
    `cache_implementation="static"` preallocates the KV cache, and on CUDA transformers then compiles the
    forward with torch.compile (its own CUDA graphs included): the fastest plain-transformers path."""
    device = hf.device
    longest = max(len(p) for p in workload.prompts)
    input_ids = torch.full((len(workload.prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(workload.prompts):
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    new_tokens = max(workload.output_lens)
    if min(workload.output_lens) != new_tokens:
        raise ValueError("HF generate() runs a batch to one length: use a workload with equal output lengths")
    clock = _TokenClock()
    _reset_peak(device)
    _sync(device)
    start = time.perf_counter()
    hf.generate(
        input_ids=input_ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id, streamer=clock,
        top_k=None, top_p=None, temperature=None, cache_implementation=cache_implementation,
    )
    _sync(device)
    end = time.perf_counter()
    batch = len(workload.prompts)
    # Every sequence of the batch gets its first token at the same moment, and its last at the end.
    system = "hf-generate" if cache_implementation is None else f"hf-generate-{cache_implementation}"
    return _metrics(system, workload, start, end, [clock.calls[1]] * batch, [end] * batch, device)


def percentile(values: Sequence[float], q: float) -> float:
    """The value below which a fraction `q` of `values` lies (the nearest one, no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def median_of(run: Callable[[], RunMetrics], repeats: int) -> RunMetrics:
    """Run `repeats` times and keep the run with the median throughput (its other figures come with it).
    For an even count that is the upper of the two middle runs; every run's figure is kept in `extra`."""
    results = sorted((run() for _ in range(repeats)), key=lambda m: m.output_tok_per_s)
    chosen = results[len(results) // 2]
    chosen.extra["repeats_tok_per_s"] = [round(r.output_tok_per_s, 2) for r in results]
    return chosen


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} torch threads, {os.cpu_count()} cores)"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def evidence_header(device: torch.device, model: str, dtype: torch.dtype, **settings: Any) -> dict[str, Any]:
    """What produced a result: enough to rerun it and to know which machine it speaks for."""
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        versions["cuda"] = torch.version.cuda
    # A copy of the tree without .git (the GPU machine's) gets the commit handed over in the environment.
    commit = os.environ.get("LLM_STEPS_GIT_COMMIT") or _git("rev-parse", "HEAD")
    dirty_env = os.environ.get("LLM_STEPS_GIT_DIRTY")
    if dirty_env is not None:
        dirty: bool | None = dirty_env == "1"
    elif commit == "unknown":
        dirty = None
    else:
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions,
        "device": device_name(device),
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        **settings,
    }


def write_json(path: str | Path, doc: Any) -> Path:
    """Write an evidence document (its folder made if needed) and say where; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return path


def write_evidence(path: str | Path, header: dict[str, Any], runs: Sequence[RunMetrics], workloads: Sequence[Workload]) -> Path:
    doc = {**header, "workloads": [w.describe() for w in workloads], "runs": [asdict(r) for r in runs]}
    return write_json(path, doc)


def format_table(runs: Sequence[RunMetrics]) -> str:
    baseline = {r.batch: r.output_tok_per_s for r in runs if r.system == "hf-generate"}
    lines = [f"{'system':<26}{'batch':>6}{'tok/s':>10}{'vs HF':>8}{'TTFT ms':>10}{'TPOT ms':>10}{'peak MB':>10}"]
    for r in runs:
        ratio = f"{r.output_tok_per_s / baseline[r.batch]:.2f}x" if r.batch in baseline else "-"
        lines.append(
            f"{r.system:<26}{r.batch:>6}{r.output_tok_per_s:>10.1f}{ratio:>8}{r.ttft_ms_median:>10.1f}"
            f"{r.tpot_ms_median:>10.1f}{r.peak_memory_mb:>10.0f}"
        )
    return "\n".join(lines)
