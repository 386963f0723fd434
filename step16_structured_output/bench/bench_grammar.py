"""What a grammar buys and what it costs: how often outputs parse with and without it, and where its time goes.

For each schema of `step16_structured_output/schemas.py`, `--prompts` chat prompts ask for a JSON object of that
schema (the schema in the message). Each prompt runs three ways on this step's engine: unconstrained greedy, then
constrained greedy and constrained sampled (`--temperature`, seeded). Recorded: the share of outputs that parse with
`json.loads`, and the share that also validate against the schema (`jsonschema`).

Then the grammar's own costs: building the tokenizer's walk once, compiling each schema (the first time, and again
from the cache), filling one row's mask at each token of a constrained output (the median and the slowest), and
applying a batch's masks to its logits on `--device`.

Last, what a grammar costs the decode loop: output tok/s of the same batch (`--decode-batch-sizes`, 32-token prompts,
`--decode-tokens` each) as free text, with every request constrained, and with every other request constrained (the
free ones beside decode at the batch's pace, so the last ratio is what constrained requests cost them). The format is
a JSON object whose one string is longer than the run (`DECODE_FORMAT`): no request ends early, and nearly the whole
vocabulary is allowed at each token, the costliest kind of mask.

    .venv/bin/python step16_structured_output/bench/bench_grammar.py                      # the embedded model, CPU
    .venv/bin/python step16_structured_output/bench/bench_grammar.py --prompts 4 --schemas enum,pattern
    .venv/bin/python step16_structured_output/bench/bench_grammar.py --model random:qwen2.5-7b --device cuda \
        --decode-batch-sizes 1,8,64 --decode-tokens 128 --repeats 3

Writes JSON evidence (by default runs/step16_structured_output/grammar-<device>-<model>.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import torch

from common.bench import Workload, default_output, evidence_header, fixed_workload, median_of, run_engine, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_names, parse_sizes
from common.config import EMBEDDED_MODEL
from common.loading import load_model
from common.sampling import SamplingParams, StructuredOutput
from step16_structured_output.bitmask import apply_token_bitmask
from step16_structured_output.engine import StructuredOutputEngine, StructuredOutputEngineConfig
from step16_structured_output.grammar import GrammarCompiler
from step16_structured_output.schemas import SCHEMAS

# A string longer than any run's output: the object never closes, so every request decodes to its length.
DECODE_FORMAT = StructuredOutput("json_schema", json.dumps({
    "type": "object", "properties": {"text": {"type": "string", "minLength": 8192}}, "required": ["text"]}))

SUBJECTS = ("a cat", "a city", "a song", "a chair", "a river", "a teacher", "a storm", "a robot", "a garden",
            "a train", "a painting", "a mountain", "a market", "a clock", "a ship", "a forest", "a bakery",
            "a violin", "a comet", "a library")


def parses(text: str, schema: dict) -> tuple[bool, bool]:
    """Whether the text is JSON, and whether it also validates against the schema."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def outputs_row(engine: StructuredOutputEngine, name: str, prompts: list[list[int]], max_tokens: int,
                temperature: float) -> dict[str, Any]:
    schema = SCHEMAS[name]
    structured = StructuredOutput("json_schema", json.dumps(schema))
    ways = {"unconstrained": SamplingParams(max_tokens=max_tokens),
            "constrained greedy": SamplingParams(max_tokens=max_tokens, structured=structured),
            "constrained sampled": SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1,
                                                  structured=structured)}
    row: dict[str, Any] = {"schema": name, "prompts": len(prompts)}
    for way, params in ways.items():
        results = [parses(c.text, schema) for c in engine.generate(prompts, params)]
        row[way] = {"parse": sum(p for p, _ in results) / len(results), "valid": sum(v for _, v in results) / len(results)}
    return row


def costs(engine: StructuredOutputEngine, names: Sequence[str], prompt: list[int], max_tokens: int,
          device: torch.device) -> dict[str, Any]:
    """The grammar's own time: the tokenizer's walk, each schema's compile, a mask per token, a batch's apply."""
    started = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size)
    tokenizer_s = time.perf_counter() - started
    compile_ms, from_cache_ms, fill_us = {}, {}, []
    for name in names:
        structured = StructuredOutput("json_schema", json.dumps(SCHEMAS[name]))
        started = time.perf_counter()
        compiler.matcher(structured)
        compile_ms[name] = (time.perf_counter() - started) * 1e3
        started = time.perf_counter()
        matcher = compiler.matcher(structured)
        from_cache_ms[name] = (time.perf_counter() - started) * 1e3
        (completion,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, structured=structured))
        for token in completion.token_ids:  # the same walk again, one mask per token, timed
            started = time.perf_counter()
            compiler.bitmask([matcher])
            fill_us.append((time.perf_counter() - started) * 1e6)
            matcher.advance(token)
    rows = 64
    logits = torch.randn(rows, engine.model.config.vocab_size, device=device)
    bitmask = compiler.bitmask([compiler.matcher(StructuredOutput("json_object")) for _ in range(rows)]).to(device)
    every_row = torch.arange(rows, device=device)
    apply_token_bitmask(logits, bitmask, every_row)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        apply_token_bitmask(logits, bitmask, every_row)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"tokenizer_walk_s": tokenizer_s, "compile_ms": compile_ms, "matcher_from_cache_ms": from_cache_ms,
            "mask_fill_us": {"tokens": len(fill_us), "median": statistics.median(fill_us), "max": max(fill_us)},
            "apply_ms": {"rows": rows, "vocab": engine.model.config.vocab_size,
                         "ms": (time.perf_counter() - started) / 20 * 1e3}}


def decode_cost(engine: StructuredOutputEngine, batch: int, tokens: int, repeats: int) -> dict[str, Any]:
    """Output tok/s of one batch free, every request constrained, every other one (from batch 2), and the ratios."""
    constrained = {"structured": DECODE_FORMAT}
    ways = {"free": [{}] * batch, "every request constrained": [constrained] * batch}
    if batch > 1:
        ways["every other request constrained"] = [constrained if i % 2 else {} for i in range(batch)]
    workload = fixed_workload(batch, 32, tokens)
    row: dict[str, Any] = {"batch": batch, "tokens": tokens}
    for way, sampling in ways.items():
        run_engine(engine, Workload("warmup", workload.prompts, [8] * batch), way, sampling)
        metrics = median_of(lambda: run_engine(engine, workload, way, sampling), repeats)  # noqa: B023
        row[way] = {"tok_per_s": metrics.output_tok_per_s, "tpot_ms": metrics.tpot_ms_median,
                    "repeats_tok_per_s": metrics.extra["repeats_tok_per_s"]}
        if way != "free":
            row[way]["vs_free"] = metrics.output_tok_per_s / row["free"]["tok_per_s"]
    return row


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=at_least(1), default=20, help=f"prompts per schema (at most {len(SUBJECTS)})")
    p.add_argument("--schemas", default=",".join(SCHEMAS), help="which of the schemas, comma-separated")
    p.add_argument("--max-tokens", type=at_least(1), default=96)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--decode-batch-sizes", default="1,8", help="batches of the decode cost (comma-separated)")
    p.add_argument("--decode-tokens", type=at_least(1), default=64, help="new tokens per request there")
    p.add_argument("--repeats", type=at_least(1), default=1, help="runs of each decode way (the median is kept)")
    p.add_argument("--output", type=Path, default=None,
                   help="evidence file (default runs/step16_structured_output/grammar-<device>-<model>.json)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        names = parse_names("--schemas", args.schemas, SCHEMAS)
        decode_batches = parse_sizes("--decode-batch-sizes", args.decode_batch_sizes)
        if args.prompts > len(SUBJECTS):
            raise CommandLineError(f"--prompts goes up to {len(SUBJECTS)}, got {args.prompts}")
    except CommandLineError as err:
        return fail(err)
    config = StructuredOutputEngineConfig(model=args.model, device=args.device, dtype=args.dtype)
    device, dtype = config.resolved_device(), config.resolved_dtype()
    engine = StructuredOutputEngine(load_model(args.model, device, dtype), config)
    header = evidence_header(device, args.model, dtype, prompts=args.prompts, schemas=names,
                             max_tokens=args.max_tokens, temperature=args.temperature, decode_batch_sizes=decode_batches,
                             decode_tokens=args.decode_tokens, repeats=args.repeats,
                             decode_format=json.loads(DECODE_FORMAT.spec))
    rows = []
    for name in names:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": (
            f"Describe {subject} as a JSON object that follows this JSON schema: {json.dumps(SCHEMAS[name])}")}])
            for subject in SUBJECTS[: args.prompts]]
        rows.append(outputs_row(engine, name, prompts, args.max_tokens, args.temperature))
        print(f"[grammar] {name}: " + ", ".join(f"{way} {rows[-1][way]['valid']:.0%} valid"
                                                for way in ("unconstrained", "constrained greedy",
                                                            "constrained sampled")), flush=True)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a cat as JSON."}])
    doc = header | {"outputs": rows, "costs": costs(engine, names, prompt, args.max_tokens, device), "decode": []}
    output = args.output or default_output("step16_structured_output", "grammar", device.type, args.model)
    write_json(output, doc)
    print(json.dumps(doc["costs"], indent=1))
    for batch in decode_batches:
        doc["decode"].append(decode_cost(engine, batch, args.decode_tokens, args.repeats))
        write_json(output, doc)  # after each batch: a run cut short keeps what it measured
        print(f"[grammar] decode at batch {batch}: " + ", ".join(
            f"{way} {doc['decode'][-1][way]['vs_free']:.3f}x free" for way in doc["decode"][-1] if "constrained" in way),
            flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
