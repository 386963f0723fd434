"""What clients send, checked on a GPU: the final engine on CUDA (float32, tiny random models of each architecture,
its graphs, overlap, speculation off and on) against references on the same device, beside plain requests.

- penalties, bias and min_p: the tokens of a decode loop written from their definitions (tests/test_sampling_controls);
- log-probabilities of greedy tokens: HF's log_softmax within 1e-4, the same top alternatives in order;
- prompt log-probabilities: HF's forward over the prompt within 1e-4, the first prompt's blocks cached before;
- and two of the sampler's kernels timed against what they replaced, on a [64, 152,064] float32 batch (Qwen2.5's
  vocabulary): the top 5 by `largest()` against `torch.topk`, the counts grown by `index_add_` against
  `index_put_(accumulate=True)`.

Run from the repository root with PYTHONPATH=. on a CUDA machine; writes $OUT/sampling-checks.json (default runs/).
An H100's record is results/gpu/sampling-checks.json. What the same fields cost was measured beside it with
`compare.py --sampling` (sampling-cost-before.json, sampling-cost-none.json and
sampling-cost-penalties-logprobs5.json); step08_serve/NOTES.md reads both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from common.bench import evidence_header
from common.loading import load_model
from common.reference import hf_model_for, reference_logits
from common.sampling import SamplingParams, largest
from common.steps import STEPS
from tests import test_logprobs, test_sampling_controls

MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
TOP = 3


def engine_for(loaded, speculative_tokens: int, **config):  # noqa: ANN001, ANN003, ANN201
    final = STEPS[-1].engine_class()
    return final(loaded, final.config_class(device="cuda", dtype="float32", speculative_tokens=speculative_tokens,
                                            num_blocks=64, **config))


def worst_difference(records, rows, token_ids) -> tuple[float, bool]:  # noqa: ANN001
    """The largest |logprob - HF's| over the records, and whether every record's alternatives are HF's top ids."""
    worst, same = 0.0, True
    for record, row, token_id in zip(records, rows, token_ids, strict=True):
        worst = max(worst, abs(record.logprob - row[token_id].item()))
        same &= [i for i, _ in record.top] == row.topk(len(record.top)).indices.tolist()
    return worst, same


def microseconds(work, repeats: int = 50) -> float:  # noqa: ANN001
    """The mean time of `work()` on the GPU, after a warm-up."""
    for _ in range(5):
        work()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        work()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / repeats * 1e3, 1)


def sampler_kernels(rows: int = 64, vocab: int = 152064, k: int = 5) -> dict:
    """The two kernels the sampler changed, timed against what they replaced on one batch of logits."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda", generator=generator)
    counts = torch.zeros(rows, vocab, device="cuda")
    row_ids = torch.arange(rows, device="cuda")  # one new token per row, as in a decode step
    token_ids = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
    one = torch.ones((), device="cuda")
    ours, theirs = largest(logits, k), logits.topk(k, dim=-1)
    return {
        "shape": [rows, vocab], "k": k,
        "largest_us": microseconds(lambda: largest(logits, k)),
        "topk_us": microseconds(lambda: logits.topk(k, dim=-1)),
        "largest_equals_topk": torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]),
        "index_add_us": microseconds(lambda: counts.view(-1).index_add_(0, row_ids * vocab + token_ids,
                                                                        one.expand(rows))),
        "index_put_accumulate_us": microseconds(lambda: counts.index_put_((row_ids, token_ids), one, accumulate=True)),
    }


def main() -> None:
    results: dict[str, dict] = {"controls": {}, "logprobs": {}, "prompt_logprobs": {},
                                "sampler_kernels": sampler_kernels()}
    for model in MODELS:
        loaded = load_model(model, device="cuda")
        hf = hf_model_for(loaded)
        prompts = [loaded.tokenizer.apply_chat_template(p) for p in test_logprobs.PARITY_PROMPTS[:3]]
        for k in (0, 4):
            for name, params in test_sampling_controls.CONTROLS.items():
                plain = SamplingParams(max_tokens=params.max_tokens, ignore_eos=True)
                got = engine_for(loaded, k).generate(prompts, [params, plain, plain])[0].token_ids
                results["controls"][f"{model} {name} k={k}"] = got == test_sampling_controls.reference_decode(
                    hf, prompts[0], params)
            plain = SamplingParams(max_tokens=12, ignore_eos=True)
            asking = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=TOP)
            engine = engine_for(loaded, k)
            request = test_logprobs.run_with_logprobs(engine, prompts, [plain, asking, plain])[1]
            tokens = request.output_token_ids
            rows = reference_logits(hf, prompts[1] + tokens)[len(prompts[1]) - 1 : -1].log_softmax(-1).cpu()
            worst, same = worst_difference(request.output_logprobs, rows, tokens)
            results["logprobs"][f"{model} k={k}"] = {"max_abs_diff": worst, "top_ids_same": same,
                                                     "greedy": tokens == rows.argmax(-1).tolist(),
                                                     "steps_taken_from_ahead": engine.steps_taken_from_ahead}
            engine = engine_for(loaded, k, max_num_batched_tokens=16)
            engine.generate([prompts[0]], SamplingParams(max_tokens=2))  # its full blocks are then cached
            scoring = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
            worst, same = 0.0, True
            for prompt, request in zip(prompts, test_logprobs.run_with_logprobs(engine, prompts, [scoring] * 3)):
                rows = reference_logits(hf, prompt)[:-1].float().log_softmax(-1).cpu()
                w, s = worst_difference(request.prompt_logprobs[1:], rows, prompt[1:])
                worst, same = max(worst, w), same and s
            results["prompt_logprobs"][f"{model} k={k}"] = {"max_abs_diff": worst, "top_ids_same": same,
                                                            "cached_prompt_tokens": engine.hit_tokens}
    print(json.dumps(results, indent=1))
    doc = evidence_header(torch.device("cuda"), ",".join(MODELS), torch.float32) | results
    out = Path(os.environ.get("OUT", "runs")) / "sampling-checks.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
