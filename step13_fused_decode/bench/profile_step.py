"""Where one decode step's GPU time goes, once the host is out of the way (CUDA only).

With graphs, a step lasts as long as the GPU needs for its kernels plus the small gaps between them. For
each batch size and each variant (plain; `--fused-ops` with cuBLAS; `--fused-ops` with the skinny matrix
multiply, without and with programmatic dependent launch), this script puts that many requests of
`--context` tokens in flight on a `FusedDecodeEngine` (one model, loaded once), then measures:
- the replayed graph's time per step (CUDA events over many replays);
- the same forward run eagerly under torch.profiler: every kernel's GPU time, summed per step and grouped
  (matrix multiplies, our attention kernels, element-wise and reductions, the rest), with the most costly
  kernels by name and how many kernels one step launches;
- the weight-read ceiling: the bytes of every weight a step reads, over the device's copy bandwidth.
Writes JSON evidence (by default runs/step13_fused_decode/profile-cuda-<model>.json, ignored by git).

    .venv/bin/python step13_fused_decode/bench/profile_step.py --model random:qwen2.5-7b --batches 1,8,64 --context 160
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_names, parse_sizes
from common.config import weight_params_per_decode_step
from common.loading import LoadedModel, load_model
from common.profiling.kernels import category_of  # the one list of kernel names, shared with the profiler
from common.sampling import SamplingParams
from common.timing import copy_bandwidth_gbs, graph_replay_ms
from step12_cuda_graph.decode_graphs import DecodeBatch
from step13_fused_decode.engine import FusedDecodeEngine, FusedDecodeEngineConfig

VARIANTS = {"plain": {"fused_ops": False},
            "fused ops, cuBLAS": {"fused_ops": True, "skinny_matmul": False, "pdl": False},
            "fused ops, skinny matmul": {"fused_ops": True, "skinny_matmul": True, "pdl": False},
            "fused ops, skinny matmul, PDL": {"fused_ops": True, "skinny_matmul": True, "pdl": True}}
VARIANT_SWITCHES = dict(zip(("plain", "cublas", "skinny", "pdl"), VARIANTS))  # the names --variants takes


def profile_point(loaded: LoadedModel, model: str, batch: int, context: int, steps: int, variant: str) -> dict:
    """One engine, `batch` requests of `context` tokens in flight: the replay timed, the kernels profiled."""
    blocks = batch * -(-(context + 8) // 16) + 8
    # A token budget that holds every prompt: the engine's default (512 tokens of a 7B) would prefill only some
    # of them in the first step. That step runs eagerly (mixed graphs off): only decode is profiled.
    engine = FusedDecodeEngine(loaded, FusedDecodeEngineConfig(model=model, device="cuda", num_blocks=blocks,
                                                               max_graph_batch=batch, attn="triton",
                                                               max_num_batched_tokens=batch * context,
                                                               mixed_graphs=False, **VARIANTS[variant]))
    for i in range(batch):  # prompts one token short of the context; their first step prefills them
        engine.add_request([1000 + (7 * i + j) % 30000 for j in range(context - 1)],
                           SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    requests = list(engine.running)
    assert len(requests) == batch and all(r.output_token_ids for r in requests), "not every prompt was prefilled"
    graphs = engine.graphs
    assert graphs is not None and graphs.graphs, engine.graph_status()
    bucket = graphs.bucket_for(len(requests))
    seq_lens = engine.grow_block_tables(requests)  # the block the step's new token goes to, if it starts one
    graphs.inputs.fill(DecodeBatch([r.output_token_ids[-1] for r in requests], seq_lens,
                                   [r.block_table for r in requests], [r.params for r in requests],
                                   [len(r.output_token_ids) for r in requests]), bucket)
    frozen_len = graphs.frozen_len_for(bucket, max(seq_lens))
    replay_ms = graph_replay_ms(graphs.graphs[bucket, False, frozen_len], steps)
    # The same step through the graph captured for the longest context, where the bucket has a short one:
    # its split count is the difference (decode_graphs.SHORT_CONTEXT).
    long_ms = graph_replay_ms(graphs.graphs[bucket, False, engine.max_model_len], steps) if (
        frozen_len != engine.max_model_len) else None

    eager_steps = max(1, steps // 4)
    graphs.forward(bucket, False, frozen_len)  # the same split count as the graph
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(eager_steps):
            graphs.forward(bucket, False, frozen_len)
        torch.cuda.synchronize()
    kernels = []
    for avg in prof.key_averages():
        us = getattr(avg, "self_device_time_total", 0.0)
        if us > 0:
            kernels.append({"name": avg.key[:120], "calls_per_step": avg.count / eager_steps,
                            "ms_per_step": us / 1e3 / eager_steps, "category": category_of(avg.key)})
    kernels.sort(key=lambda k: -k["ms_per_step"])
    by_category: dict[str, float] = defaultdict(float)
    for k in kernels:
        by_category[k["category"]] += k["ms_per_step"]
    point = {"batch": batch, "bucket": bucket, "context": context, "variant": variant, **VARIANTS[variant],
             "graph_captured_for_tokens": frozen_len, "replay_ms_per_step": replay_ms,
             "replay_ms_per_step_longest_context_graph": long_ms, "kernel_ms_per_step": sum(by_category.values()),
             "kernels_per_step": sum(k["calls_per_step"] for k in kernels),
             "ms_per_step_by_category": dict(by_category), "top_kernels": kernels[:25]}
    del engine, graphs
    torch.cuda.empty_cache()
    return point


def main() -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen2.5-7b")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=at_least(1), default=160, help="tokens each request holds during the step")
    p.add_argument("--steps", type=at_least(1), default=20, help="replays timed, and eager steps profiled (a quarter)")
    p.add_argument("--variants", default=",".join(VARIANT_SWITCHES),
                   help=f"which variants to profile, of {','.join(VARIANT_SWITCHES)} (default: all)")
    p.add_argument("--output", type=Path, default=None,
                   help="evidence file (default runs/step13_fused_decode/profile-cuda-<model>.json)")
    args = p.parse_args()
    try:  # before the model loads: a bad value is one line and exit code 2
        check_args(args)
        batches = parse_sizes("--batches", args.batches)
        variants = parse_names("--variants", args.variants, VARIANT_SWITCHES)
    except CommandLineError as err:
        return fail(err)
    if not torch.cuda.is_available():
        print("error: this profiles CUDA kernels and graphs: run it on a GPU machine", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    loaded = load_model(args.model, device, torch.bfloat16)
    copy_gbs = copy_bandwidth_gbs(device)
    weight_bytes = weight_params_per_decode_step(loaded.model.config) * loaded.model.dtype.itemsize
    ceiling_ms = weight_bytes / (copy_gbs * 1e9) * 1e3  # reading every weight once, at the copy bandwidth
    header = evidence_header(device, args.model, loaded.model.dtype, context=args.context, steps=args.steps,
                             copy_bandwidth_gbs=copy_gbs, weight_bytes_read=weight_bytes,
                             weight_read_ceiling_ms=ceiling_ms)
    points = []
    for batch in batches:
        for variant in (VARIANT_SWITCHES[name] for name in variants):
            point = profile_point(loaded, args.model, batch, args.context, args.steps, variant)
            point["replay_vs_ceiling"] = ceiling_ms / point["replay_ms_per_step"]
            points.append(point)
            longest = point["replay_ms_per_step_longest_context_graph"]
            longest_text = f" ({longest:.2f} ms with the longest-context graph)" if longest else ""
            print(f"batch {batch} (bucket {point['bucket']}), {variant}: replay "
                  f"{point['replay_ms_per_step']:.2f} ms per step{longest_text}; kernels "
                  f"{point['kernel_ms_per_step']:.2f} ms in "
                  f"{point['kernels_per_step']:.0f} launches; weight-read ceiling {ceiling_ms:.2f} ms "
                  f"({100 * point['replay_vs_ceiling']:.0f}% of it reached)", flush=True)
            for name, ms in sorted(point["ms_per_step_by_category"].items(), key=lambda kv: -kv[1]):
                print(f"  {name:30s} {ms:7.3f} ms")
            for k in point["top_kernels"][:8]:
                print(f"  {k['ms_per_step']:7.3f} ms  x{k['calls_per_step']:5.0f}  {k['name'][:90]}")
    output = args.output or default_output("step13_fused_decode", "profile-cuda", args.model)
    write_json(output, header | {"points": points})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
