"""FP8 weights against the same engine as loaded (bf16 on a GPU), in one process.

For each quantization (none, then fp8) step 17's engine is built as the command line builds it, loading the model
for itself (so with FP8 its KV pool gets the memory the quantized projections gave back), with its defaults (on a
GPU: CUDA graphs and step 13's fused decode), and times each workload: `--batches` requests of 32 prompt
tokens and 128 new tokens each, and with `--nanovllm` the 256-sequence workload (lengths uniform in [100, 1024]).
Each figure is the median of `--repeats` runs after a warm-up; fp8 is reported as a ratio of none. Also written:
the engines' memory reports (the weights held), the weight bytes a decode step reads and the device's copy
bandwidth (the batch-1 ceiling is one over the other), and how many greedy tokens of the first batch's requests the
two give alike.

    .venv/bin/python step17_fp8_weights/bench/bench_fp8.py --batches 1,4 --max-tokens 16
    python step17_fp8_weights/bench/bench_fp8.py --device cuda --model random:qwen2.5-7b --batches 1,8,64 \\
        --output results/gpu/fp8-decode.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from common.bench import (Workload, default_output, evidence_header, fixed_workload, nanovllm_workload, run_engine,
                          write_json)
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_sizes
from common.loading import EMBEDDED_MODEL
from common.sampling import SamplingParams
from common.timing import memory_bandwidth_gbs
from step17_fp8_weights.engine import Fp8WeightsEngine, Fp8WeightsEngineConfig
from step17_fp8_weights.fp8 import weight_bytes

STEP = "step17_fp8_weights"
MODES = {"as loaded": None, "fp8": "fp8"}


def make_engine(config: Fp8WeightsEngineConfig) -> Fp8WeightsEngine:
    gc.collect()  # the last engine's model, pool and graphs go back before this one loads and sizes its own
    if config.resolved_device().type == "cuda":
        torch.cuda.empty_cache()
    return Fp8WeightsEngine.from_config(config)


def step_read_bytes(model: torch.nn.Module) -> int:
    """The weight bytes a decode step at batch 1 reads: every weight but the embedding, of which a step reads a
    row (unless it is the output head too, read whole)."""
    embedding = model.model.embed_tokens.weight
    tied = embedding.data_ptr() == model.lm_head.weight.data_ptr()
    return weight_bytes(model) - (0 if tied else embedding.nbytes)


def measure(engine: Fp8WeightsEngine, workloads: list[Workload], repeats: int) -> dict[str, float]:
    """Output tokens per second on each workload: the median of `repeats` runs after a short warm-up."""
    speeds = {}
    for workload in workloads:
        run_engine(engine, Workload("warm-up", workload.prompts, [min(n, 8) for n in workload.output_lens]), STEP)
        runs = [run_engine(engine, workload, STEP).output_tok_per_s for _ in range(repeats)]
        speeds[workload.name] = statistics.median(runs)
        print(f"[fp8] {workload.name}: {speeds[workload.name]:,.1f} tok/s", flush=True)
    return speeds


def main() -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", default="1,8,64", help="decode batches timed (empty: none)")
    p.add_argument("--max-tokens", type=at_least(1), default=128, help="new tokens per request of those batches")
    p.add_argument("--nanovllm", action="store_true", help="also time the 256-sequence workload")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--output", type=Path, default=None, help="evidence file (default runs/step17_fp8_weights/...)")
    args = p.parse_args()
    try:  # before the model loads: a bad value is one line and exit code 2
        check_args(args)
        batches = parse_sizes("--batches", args.batches) if args.batches else []
        if not batches and not args.nanovllm:
            raise CommandLineError("nothing to time: give --batches or --nanovllm")
    except CommandLineError as err:
        return fail(err)
    workloads = [fixed_workload(b, 32, args.max_tokens) for b in batches]
    workloads += [nanovllm_workload()] if args.nanovllm else []
    largest = max(len(w.prompts) for w in workloads)
    config = Fp8WeightsEngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=largest)
    device = config.resolved_device()
    doc: dict[str, Any] = evidence_header(device, args.model, config.resolved_dtype(), step=STEP,
                                          repeats=args.repeats, workloads=[w.name for w in workloads],
                                          copy_bandwidth_gbs=memory_bandwidth_gbs(device))
    output = args.output or default_output(STEP, "fp8", device.type, args.model)
    greedy = SamplingParams(max_tokens=min(args.max_tokens, 64), temperature=0, ignore_eos=True)
    tokens = {}
    for mode, quantization in MODES.items():
        engine = make_engine(replace(config, quantization=quantization))
        doc.setdefault("memory_report", {})[mode] = engine.memory_report()
        doc.setdefault("weight_bytes", {})[mode] = weight_bytes(engine.model)
        doc.setdefault("step_read_bytes", {})[mode] = step_read_bytes(engine.model)
        if workloads[0].prompts:
            tokens[mode] = [c.token_ids for c in engine.generate(workloads[0].prompts, greedy)]
        doc.setdefault("tok_per_s", {})[mode] = measure(engine, workloads, args.repeats)
        del engine
        write_json(output, doc)  # after each mode: a cut-short run keeps its figures
    speeds = doc["tok_per_s"]
    doc["fp8_vs_as_loaded"] = {name: speeds["fp8"][name] / speeds["as loaded"][name] for name in speeds["fp8"]}
    pairs = [(a, b) for x, y in zip(tokens["as loaded"], tokens["fp8"]) for a, b in zip(x, y)]
    doc["greedy_agreement"] = {"tokens": len(pairs), "same": sum(a == b for a, b in pairs)}
    print("fp8 as a ratio of the weights as loaded: "
          + ", ".join(f"{name}: {ratio:.2f}x" for name, ratio in doc["fp8_vs_as_loaded"].items()))
    print(f"greedy tokens alike: {doc['greedy_agreement']['same']} of {doc['greedy_agreement']['tokens']}")
    write_json(output, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
