"""Speculation on and off on the same requests, one at a time (batch 1, where a step is bound by reading the
weights and several tokens per forward pay most). Two workloads:

- grounded: the answer copies from the prompt (repeat a text with a fix, extract its names, edit a piece of
  code): what n-gram lookup is for;
- chat: plain questions, whose answers repeat little of the prompt.

For each workload and each `--speculative-tokens` value (0 is speculation off, the baseline), under the rule
that picks which proposals to check, and once more for the largest k with every proposal checked; greedy: the
output tokens per second, the proposals made and kept, the tokens per verification row, and whether the
tokens equal the baseline's (they must). Writes JSON evidence (by default
runs/step11_speculative_decoding/speculative-<device>-<model>.json).

    .venv/bin/python step11_speculative_decoding/bench/bench_speculative.py                 # CPU, the embedded model
    .venv/bin/python step11_speculative_decoding/bench/bench_speculative.py --ks 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from common.bench import default_output, evidence_header, write_json
from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_sizes
from common.loading import EMBEDDED_MODEL, LoadedModel, ModelLoadError, load_model
from common.prompts import PARITY_PROMPTS
from common.sampling import SamplingParams
from step11_speculative_decoding.engine import SpeculativeEngine, SpeculativeEngineConfig

PARAGRAPH = ("Ada Lovelace worked with Charles Babbage on the Analytical Engine in London. In 1843 she "
             "published a translation of an article by Luigi Menabrea, adding notes longer than the article "
             "itself; the last of them describes how the engine could compute Bernoulli numbers.")
CODE = ("def total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n\n\n"
        "def mean(xs):\n    s = total(xs)\n    return s / len(xs)\n")
GROUNDED = [
    f"Repeat this text exactly, but write the year in words:\n\n{PARAGRAPH}",
    f"List every person named in this text, one per line:\n\n{PARAGRAPH}",
    f"Rename the variable s to result in this Python code and show the whole code:\n\n{CODE}",
    f"Add a docstring to each function in this Python code and show the whole code:\n\n{CODE}",
]
WORKLOADS = {"grounded": GROUNDED, "chat": list(PARITY_PROMPTS[:4])}


def run_workload(loaded: LoadedModel, prompts: Sequence[str], k: int, token_cost: float | None,
                 args: argparse.Namespace) -> tuple[dict[str, Any], list[list[int]]]:
    engine = SpeculativeEngine(loaded, SpeculativeEngineConfig(device=args.device, speculative_tokens=k,
                                                               speculative_token_cost=token_cost))
    params = SamplingParams(max_tokens=args.max_tokens)
    ids = [loaded.tokenizer.apply_chat_template(p) for p in prompts]
    engine.generate(ids[:1], SamplingParams(max_tokens=4))  # warm-up
    engine.proposed_tokens = engine.accepted_tokens = engine.verify_rows = 0
    outputs, steps, start = [], 0, time.perf_counter()
    for prompt in ids:  # one at a time: batch 1
        rid = engine.add_request(prompt, params)
        request = engine.requests[rid]
        while engine.has_unfinished():
            engine.step()
            steps += 1
        outputs.append(request.output_token_ids)
    elapsed = time.perf_counter() - start
    emitted = sum(len(o) for o in outputs)
    return {"speculative_tokens": k, "token_cost": engine.token_cost, "step_cost": engine.step_cost,
            "requests": len(ids), "output_tokens": emitted, "elapsed_s": elapsed,
            "output_tok_per_s": emitted / elapsed, "steps": steps, "proposed": engine.proposed_tokens,
            "accepted": engine.accepted_tokens, "verify_rows": engine.verify_rows,
            "acceptance_rate": engine.accepted_tokens / engine.proposed_tokens if engine.proposed_tokens else None,
            "tokens_per_verify_row": ((engine.verify_rows + engine.accepted_tokens) / engine.verify_rows
                                      if engine.verify_rows else None)}, outputs


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ks", default="2,4,8", help="--speculative-tokens values to compare with speculation off")
    p.add_argument("--max-tokens", type=at_least(1), default=128)
    p.add_argument("--workloads", default="grounded,chat")
    p.add_argument("--output", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        ks = [0, *sorted(set(parse_sizes("--ks", args.ks)))]
        workloads = args.workloads.split(",")
        unknown = set(workloads) - set(WORKLOADS)
        if unknown:
            raise CommandLineError(f"--workloads: no workload {', '.join(sorted(unknown))}; give {', '.join(WORKLOADS)}")
        loaded = load_model(args.model, torch.device(args.device), torch.float32)
    except (CommandLineError, ModelLoadError, ValueError) as err:
        return fail(err)
    rows = []
    for name in workloads:
        baseline, base_rate = [], 0.0
        # Speculation off, then each k under the rule, then the largest k with every proposal checked (token
        # cost 0): what the rule saves where proposals fail.
        for k, token_cost in [(k, None) for k in ks] + [(ks[-1], 0.0)]:
            row, outputs = run_workload(loaded, WORKLOADS[name], k, token_cost, args)
            if k == 0:
                baseline, base_rate = outputs, row["output_tok_per_s"]
            row = {"workload": name, **row, "identical_to_off": outputs == baseline,
                   "speedup": row["output_tok_per_s"] / base_rate}
            rows.append(row)
            rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}"
            rule = " (every proposal checked)" if token_cost == 0 else ""
            print(f"[{name}] k={k}{rule}: {row['output_tok_per_s']:.1f} tok/s ({row['speedup']:.2f}x), kept {rate} of "
                  f"{row['proposed']} proposals, identical: {row['identical_to_off']}", flush=True)
    header = evidence_header(loaded.model.device, args.model, loaded.model.dtype,
                             settings={"ks": ks, "max_tokens": args.max_tokens, "workloads": workloads})
    write_json(args.output or default_output("step11_speculative_decoding", "speculative", args.device, args.model),
               header | {"runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
