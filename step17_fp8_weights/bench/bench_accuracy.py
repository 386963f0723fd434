"""What FP8 weights cost in accuracy: the embedded model in float32 against the same model with its projections in
e4m3, with a scale per row and with one per tensor, on the CPU (the multiply by the dequantized weight is what a
GPU kernel computes, up to the order of its sums).

For each: the perplexity of a fixed text (`tests/data/perplexity_text.md`, scored in one forward); each decoder
layer's output on that text against float32's (relative error, the norm of the difference over the norm); and
greedy decoding of `--prompts` chat prompts for `--max-tokens` tokens, against float32's tokens: the share of
positions with the same token, and how many tokens the two agree on before they first differ.

    .venv/bin/python step17_fp8_weights/bench/bench_accuracy.py
    .venv/bin/python step17_fp8_weights/bench/bench_accuracy.py --prompts 4 --max-tokens 16 --text-tokens 256

Writes JSON evidence (by default runs/step17_fp8_weights/accuracy-<device>-<model>.json).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common.bench import default_output, evidence_header, write_json
from common.cli import Parser, at_least, check_args, fail, CommandLineError
from common.config import EMBEDDED_MODEL
from common.loading import LoadedModel, load_model
from common.prompt_logprobs import WholePromptForward
from common.sampling import SamplingParams
from step06_paged_attention.engine import PagedAttentionEngine, PagedAttentionEngineConfig
from step16_structured_output.bench.bench_grammar import SUBJECTS
from step17_fp8_weights.fp8 import quantize_projections

TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "perplexity_text.md"
VARIANTS = {"float32": None, "fp8, a scale per row": True, "fp8, one scale per tensor": False}


@torch.inference_mode()
def score_text(loaded: LoadedModel, ids: list[int]) -> tuple[float, list[torch.Tensor]]:
    """The text's perplexity under the model, and each decoder layer's output on it."""
    model = loaded.model
    outputs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: outputs.append(out.float()))
             for layer in model.model.layers]
    tokens = torch.tensor(ids)
    hidden = model(tokens, WholePromptForward(len(ids), model.device))
    for hook in hooks:
        hook.remove()
    logprobs = model.compute_logits(hidden[:-1]).log_softmax(dim=-1)
    mean = logprobs.gather(-1, tokens[1:, None]).mean().item()
    return math.exp(-mean), outputs


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """The share of positions with the reference's token, and the mean count of tokens before the first that
    differs."""
    same = [a == b for got, want in zip(tokens, reference, strict=True) for a, b in zip(got, want)]
    prefixes = [next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                for got, want in zip(tokens, reference, strict=True)]
    return {"same_token_share": sum(same) / len(same), "agreed_prefix_mean": statistics.mean(prefixes)}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--prompts", type=at_least(1), default=20, help=f"chat prompts (at most {len(SUBJECTS)})")
    p.add_argument("--max-tokens", type=at_least(1), default=64)
    p.add_argument("--text-tokens", type=at_least(2), default=4096, help="the text's tokens scored, at most")
    p.add_argument("--output", type=Path, default=None,
                   help="evidence file (default runs/step17_fp8_weights/accuracy-<device>-<model>.json)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        if args.prompts > len(SUBJECTS):
            raise CommandLineError(f"--prompts goes up to {len(SUBJECTS)}, got {args.prompts}")
    except CommandLineError as err:
        return fail(err)
    device = torch.device("cpu")
    # Taken before the runs: the commit and dirty flag describe the code that is about to run.
    header = evidence_header(device, args.model, torch.float32, prompts=args.prompts, max_tokens=args.max_tokens,
                             text=str(TEXT.relative_to(TEXT.parents[2])))
    rows: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}
    for name, per_row in VARIANTS.items():
        loaded = load_model(args.model, device)
        weight_bytes = sum(t.nbytes for t in [*loaded.model.parameters(), *loaded.model.buffers()])
        if per_row is not None:
            weight_bytes -= quantize_projections(loaded.model, per_row)
        tokenizer = loaded.tokenizer
        ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"))[: args.text_tokens]
        perplexity, layer_outputs = score_text(loaded, ids)
        prompts = [tokenizer.apply_chat_template(f"Write three sentences about {subject}.")
                   for subject in SUBJECTS[: args.prompts]]
        engine = PagedAttentionEngine(loaded, PagedAttentionEngineConfig(device="cpu", num_blocks=1024))
        tokens = [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens,
                                                                               ignore_eos=True))]
        row: dict[str, Any] = {"variant": name, "weight_bytes": weight_bytes, "text_tokens": len(ids),
                               "perplexity": perplexity}
        if per_row is None:
            reference = {"perplexity": perplexity, "layers": layer_outputs, "tokens": tokens}
        else:
            row["perplexity_vs_float32"] = perplexity / reference["perplexity"]
            row["layer_relative_error"] = [((got - want).norm() / want.norm()).item()
                                           for got, want in zip(layer_outputs, reference["layers"], strict=True)]
            row |= agreement(tokens, reference["tokens"])
        rows.append(row)
        print(f"[accuracy] {name}: perplexity {perplexity:.3f}" + (
            f" ({row['perplexity_vs_float32']:.4f}x), same token {row['same_token_share']:.1%}, agreed for "
            f"{row['agreed_prefix_mean']:.1f} tokens, last layer's error {row['layer_relative_error'][-1]:.2%}"
            if per_row is not None else ""), flush=True)
    write_json(args.output or default_output("step17_fp8_weights", "accuracy", device.type, args.model),
               header | {"variants": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
