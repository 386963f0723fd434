"""Batch invariance measured: do requests come back the same alone and together, and what does the mode cost?

Every part runs step 15's engine twice, with `--batch-invariant` off and on, over one loaded model:
- `together`: N different greedy requests submitted at once, then the same N one at a time; how many of the
  N come back with the same token ids;
- `server`: the same through step 08's server and the openai SDK: N streaming chat completions at once,
  then one at a time; how many texts are the same;
- `speculation`: greedy requests decoded with n-gram speculation (step 11) and without; how many are equal;
- `decode`: output tokens per second decoding `--batches` requests of 32 prompt tokens, 128 new tokens each,
  and with `--long-prompt N` one request of N prompt tokens (its prefill counted in): a long context, which
  step 15's decode attention splits only into 1,024-key pieces;
- `nanovllm`: the 256-sequence workload (lengths uniform in [100, 1024]).
Speeds are reported with the mode on as a ratio of off, measured in the same process.

    .venv/bin/python step15_batch_invariant/bench/bench_invariance.py --parts together,speculation --requests 8 --max-tokens 24
    python step15_batch_invariant/bench/bench_invariance.py --device cuda --model random:qwen2.5-7b \\
        --parts together,server,speculation,decode --output results/gpu/batch-invariance.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
from pathlib import Path
from typing import Any

import torch
from openai import AsyncOpenAI

from common.bench import (default_output, evidence_header, fixed_workload, nanovllm_workload, run_engine,
                          write_json)
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_names, parse_sizes
from common.loading import EMBEDDED_MODEL, LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.sampling import SamplingParams
from step08_serve.bench.bench_serve import server_process
from step15_batch_invariant.engine import BatchInvariantEngine, BatchInvariantEngineConfig

PARTS = ("together", "server", "speculation", "decode", "nanovllm")
STEP = "step15_batch_invariant"


def release_memory(device: torch.device) -> None:
    """Give the last engine's pool and graphs back, before another engine sizes its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_engine(loaded: LoadedModel, invariant: bool, max_num_seqs: int, **config: Any) -> BatchInvariantEngine:
    release_memory(loaded.model.device)
    return BatchInvariantEngine(loaded, BatchInvariantEngineConfig(
        model=loaded.name, device=str(loaded.model.device), batch_invariant=invariant, max_num_seqs=max_num_seqs,
        **config))


def prompts_for(loaded: LoadedModel, count: int) -> list[list[int]]:
    """`count` different chat prompts: the parity prompts, each asked again with a number once they run out."""
    texts = [f"{PARITY_PROMPTS[i % len(PARITY_PROMPTS)]} ({i // len(PARITY_PROMPTS)})" for i in range(count)]
    return [loaded.tokenizer.apply_chat_template(t) for t in texts]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def together_and_alone(engine: BatchInvariantEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    together = [c.token_ids for c in engine.generate(prompts, greedy(max_tokens))]
    alone = [engine.generate([p], greedy(max_tokens))[0].token_ids for p in prompts]
    same = sum(a == b for a, b in zip(together, alone))
    return {"requests": len(prompts), "same": same, "first_difference_at": first_differences(together, alone)}


def first_differences(runs: list[list[int]], others: list[list[int]]) -> list[int]:
    """For each pair that differs, the index of the first token that does."""
    return [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(runs, others) if a != b]


def speculation(loaded: LoadedModel, invariant: bool, prompts: list[list[int]], max_tokens: int,
                draft_model: str | None, budget: int | None) -> dict[str, Any]:
    """Greedy tokens with k = 0 and 4 proposals, n-gram or from `draft_model`. The target itself as its draft
    proposes the tokens it would pick: every proposal should be kept, so every token is verified."""
    runs, stats = [], {}
    method = {"speculative_method": "draft", "draft_model": draft_model} if draft_model else {}
    for k in (0, 4):
        # Costs of 0: proposals always pay, so that every decode step with a proposal verifies it.
        engine = make_engine(loaded, invariant, len(prompts), max_num_batched_tokens=budget, speculative_tokens=k,
                             speculative_token_cost=0.0, speculative_step_cost=0.0, speculative_decode_token_cost=0.0,
                             **(method if k else {}))
        runs.append([c.token_ids for c in engine.generate(prompts, greedy(max_tokens))])
        stats = engine.stats()
        del engine
    return {"requests": len(prompts), "same": sum(a == b for a, b in zip(*runs)),
            "first_difference_at": first_differences(*runs),
            "proposed": stats["speculative_proposed_total"], "accepted": stats["speculative_accepted_total"]}


async def chat(client: AsyncOpenAI, model: str, text: str, max_tokens: int) -> str:
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])


async def served_together_and_alone(base_url: str, model: str, texts: list[str], max_tokens: int) -> dict[str, Any]:
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=1800) as client:
        together = await asyncio.gather(*[chat(client, model, t, max_tokens) for t in texts])
        alone = [await chat(client, model, t, max_tokens) for t in texts]
    return {"requests": len(texts), "same": sum(a == b for a, b in zip(together, alone))}


def speed(loaded: LoadedModel, invariant: bool, batches: list[int], long_prompt: int,
          nanovllm: bool) -> dict[str, float]:
    """Output tokens per second for each decode batch, one long prompt and the 256-sequence workload where
    asked."""
    workloads = [fixed_workload(b, 32, 128) for b in batches]
    if long_prompt:
        workloads.append(fixed_workload(1, long_prompt, 128))
    if nanovllm:
        workloads.append(nanovllm_workload())
    engine = make_engine(loaded, invariant, max(len(w.prompts) for w in workloads))
    result = {}
    for workload in workloads:
        run_engine(engine, fixed_workload(len(workload.prompts), 32, 8, seed=1), "warm-up")
        result[workload.name] = run_engine(engine, workload, STEP).output_tok_per_s
    del engine
    return result


def main() -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--parts", default="together,speculation", help=f"comma-separated, of: {', '.join(PARTS)}")
    p.add_argument("--requests", type=int, default=32, help="requests sent together, then one at a time")
    p.add_argument("--max-tokens", type=at_least(1), default=64, help="tokens each of those requests generates")
    p.add_argument("--batches", default="1,8,64", help="decode batches timed by the `decode` part")
    p.add_argument("--max-num-batched-tokens", type=at_least(1), default=None,
                   help="the token budget of the together, server and speculation parts: a small one cuts prompts "
                        "sent together into chunks at other places than alone (default: the engine's)")
    p.add_argument("--long-prompt", type=at_least(0), default=0,
                   help="the `decode` part also times one request of this many prompt tokens (default: none)")
    p.add_argument("--draft-model", default=None,
                   help="the `speculation` part's proposer: this model as a draft (default: n-gram proposals)")
    p.add_argument("--output", type=Path, default=None, help="evidence file (default runs/step15_batch_invariant/...)")
    args = p.parse_args()
    try:  # before the model loads: a bad value is one line and exit code 2
        check_args(args)
        parts = parse_names("--parts", args.parts, PARTS)
        batches = parse_sizes("--batches", args.batches)
    except CommandLineError as err:
        return fail(err)
    config = BatchInvariantEngineConfig(model=args.model, device=args.device, dtype=args.dtype)
    loaded = load_model(args.model, config.resolved_device(), config.resolved_dtype(), config.seed)
    device = loaded.model.device
    header = evidence_header(device, args.model, loaded.model.dtype, step=STEP, requests=args.requests,
                             max_tokens=args.max_tokens, parts=parts)
    output = args.output or default_output(STEP, "invariance", device.type, args.model)
    prompts = prompts_for(loaded, args.requests)
    doc: dict[str, Any] = dict(header)
    for invariant in (False, True):
        mode = "on" if invariant else "off"
        if "together" in parts:
            engine = make_engine(loaded, invariant, args.requests, max_num_batched_tokens=args.max_num_batched_tokens)
            doc.setdefault("together", {})[mode] = together_and_alone(engine, prompts, args.max_tokens)
            del engine
        if "speculation" in parts:
            doc.setdefault("speculation", {})[mode] = speculation(loaded, invariant, prompts, args.max_tokens,
                                                                  args.draft_model, args.max_num_batched_tokens)
        if "server" in parts:
            server_argv = ["--step", STEP, "--model", args.model, "--device", str(device.type), "--dtype", args.dtype,
                           "--max-num-seqs", str(args.requests), *(["--batch-invariant"] if invariant else []),
                           *(["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
                             if args.max_num_batched_tokens else [])]
            texts = [f"{PARITY_PROMPTS[i % len(PARITY_PROMPTS)]} ({i // len(PARITY_PROMPTS)})"
                     for i in range(args.requests)]
            release_memory(device)  # the server is another process: it sizes its pool from what this one frees
            with server_process(server_argv) as base_url:
                doc.setdefault("server", {})[mode] = asyncio.run(
                    served_together_and_alone(base_url, args.model, texts, args.max_tokens))
        if "decode" in parts or "nanovllm" in parts:
            decode = "decode" in parts
            doc.setdefault("speed", {})[mode] = speed(loaded, invariant, batches if decode else [],
                                                      args.long_prompt if decode else 0, "nanovllm" in parts)
        write_json(output, doc)
    if "speed" in doc:
        doc["speed"]["on_vs_off"] = {name: doc["speed"]["on"][name] / off for name, off in doc["speed"]["off"].items()}
    for part in ("together", "server", "speculation"):
        if part in doc:
            print(f"{part}: " + "; ".join(f"mode {m}: {r['same']}/{r['requests']} the same"
                                          for m, r in doc[part].items()))
    if "speed" in doc:
        print("speed, on as a ratio of off: " + ", ".join(f"{n}: {r:.2f}x" for n, r in doc["speed"]["on_vs_off"].items()))
    write_json(output, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
