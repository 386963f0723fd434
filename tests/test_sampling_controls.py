"""Penalties, min_p and logit_bias on every engine path: against HF's repetition penalty, and against a decode loop
written from the definitions (OpenAI's presence and frequency penalties, min_p, logit_bias)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import PreTrainedModel

from common.engine import Engine
from common.loading import LoadedModel, load_model
from common.prompts import PARITY_PROMPTS
from common.reference import hf_model_for, reference_logits
from common.sampling import Sampler, SamplingParams
from common.steps import STEPS, engine_class

MAX_TOKENS = 12
STEP_NAMES = ["step01_serial", "step10_prefix_caching", STEPS[-1].name]
ALWAYS_PROPOSE = {"speculative_token_cost": 0.0, "speculative_step_cost": 0.0, "speculative_decode_token_cost": 0.0}
# Each path of the final engine: eager, a small token budget (prompts in chunks, mixed steps), speculation on (other
# requests verify proposals beside the controlled one), the host overlapped with decode.
FINAL_CONFIGS = {"eager": {}, "budget": {"max_num_batched_tokens": 16},
                 "speculative": {"speculative_tokens": 4, **ALWAYS_PROPOSE}, "overlap": {"overlap": True}}
CONTROLS = {
    "presence": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=1.5),
    "frequency": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=1.2, presence_penalty=-0.3),
    "repetition": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.4),
    "bias": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={11: 8.0, 12: -100.0, 30: 3.5}),
    "min_p": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.5, min_p=0.3, seed=7),
}


def by_definition(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One logits row changed as the definitions say, token by token."""
    logits = logits.clone()
    for token, bias in p.logit_bias.items():
        logits[token] += bias
    for token in set(prompt + output):
        r = p.repetition_penalty
        logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token in set(output):
        logits[token] -= output.count(token) * p.frequency_penalty + p.presence_penalty
    if p.min_p:
        probs = (logits / p.temperature).softmax(-1)
        logits[probs < p.min_p * probs.max()] = float("-inf")
    return logits


def reference_decode(hf: PreTrainedModel, prompt: list[int], p: SamplingParams) -> list[int]:
    """HF's logits at each position, changed `by_definition`, then the plain sampler (no controls) picks."""
    plain = dataclasses.replace(p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0,
                                logit_bias={})
    output: list[int] = []
    for _ in range(p.max_tokens):
        logits = by_definition(reference_logits(hf, prompt + output)[-1], prompt, output, p)
        output.append(int(Sampler()(logits[None], [plain], [len(output)])[0]))
    return output


def make_engine(loaded: LoadedModel, step: str, **config: object) -> Engine:
    cls = engine_class(step)
    return cls(loaded, cls.config_class(device="cpu", **config))


def prompts_for(loaded: LoadedModel, n: int) -> list[list[int]]:
    return [loaded.tokenizer.apply_chat_template(p) for p in PARITY_PROMPTS[:n]]


@pytest.fixture(scope="module")
def tiny_llama_hf() -> tuple[LoadedModel, PreTrainedModel]:
    loaded = load_model("tiny-llama", device="cpu")
    return loaded, hf_model_for(loaded)


def test_repetition_penalty_matches_hf_generate(tiny: LoadedModel) -> None:
    """Greedy with repetition_penalty: step 01 and the final engine give HF generate's tokens, on each tiny model."""
    hf = hf_model_for(tiny)
    # Each prompt followed twice by its own greedy answer: the penalty then falls on the tokens greedy would pick.
    plain = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [p + c.token_ids * 2 for p, c in zip(prompts_for(tiny, 2), make_engine(tiny, STEPS[0].name).generate(
        prompts_for(tiny, 2), plain))]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=2.0)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                          min_new_tokens=MAX_TOKENS, do_sample=False, repetition_penalty=2.0, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    assert expected != [c.token_ids for c in make_engine(tiny, STEPS[0].name).generate(prompts, plain)]
    for step in (STEPS[0].name, STEPS[-1].name):
        got = [c.token_ids for c in make_engine(tiny, step).generate(prompts, params)]
        assert got == expected, step


@pytest.mark.embedded
def test_repetition_penalty_matches_hf_generate_on_the_embedded_model(embedded: LoadedModel,
                                                                       embedded_hf: PreTrainedModel) -> None:
    prompts = prompts_for(embedded, 2)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = embedded_hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                   min_new_tokens=16, do_sample=False, repetition_penalty=1.3, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    params = SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    got = [c.token_ids for c in make_engine(embedded, STEPS[-1].name).generate(prompts, params)]
    assert got == expected


@pytest.mark.parametrize("control", list(CONTROLS))
@pytest.mark.parametrize(("step", "config"), [(s, {}) for s in STEP_NAMES[:2]]
                         + [(STEPS[-1].name, c) for c in FINAL_CONFIGS.values()],
                         ids=STEP_NAMES[:2] + [f"final-{name}" for name in FINAL_CONFIGS])
def test_controls_follow_their_definitions_batched_with_plain_requests(
        tiny_llama_hf: tuple[LoadedModel, PreTrainedModel], control: str, step: str, config: dict) -> None:
    """A controlled request batched with plain ones (whose repeated text invites proposals) gets the reference's
    tokens; the plain ones get plain greedy decoding's."""
    loaded, hf = tiny_llama_hf
    prompts = prompts_for(loaded, 3)
    plain = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [CONTROLS[control], plain, plain]
    got = [c.token_ids for c in make_engine(loaded, step, **config).generate(prompts, params)]
    assert got[0] == reference_decode(hf, prompts[0], CONTROLS[control])
    assert got[1:] == [c.token_ids for c in make_engine(loaded, STEPS[0].name).generate(prompts[1:], plain)]


def test_a_controlled_request_gets_no_proposals(tiny_llama_hf: tuple[LoadedModel, PreTrainedModel]) -> None:
    """Penalties depend on every token before: a request with one decodes one token a step, never verifies."""
    loaded, _ = tiny_llama_hf
    engine = make_engine(loaded, STEPS[-1].name, speculative_tokens=4, **ALWAYS_PROPOSE)
    engine.generate(prompts_for(loaded, 1), CONTROLS["presence"])
    assert engine.proposed_tokens == 0
    engine.generate(prompts_for(loaded, 1), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert engine.proposed_tokens > 0


@pytest.mark.parametrize("control", list(CONTROLS))
def test_overlap_gives_the_tokens_of_the_plain_schedule(tiny_llama_hf: tuple[LoadedModel, PreTrainedModel],
                                                        control: str) -> None:
    """Step 14 launches a controlled batch ahead too, its penalties counting on the device the token the host has
    not appended yet: the same tokens as with overlap off, for every request of a mixed batch."""
    loaded, _ = tiny_llama_hf
    prompts = prompts_for(loaded, 3)
    params = [CONTROLS[control], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), CONTROLS[control]]
    engines = {on: make_engine(loaded, STEPS[-1].name, overlap=on) for on in (True, False)}
    runs = {on: [c.token_ids for c in engine.generate(prompts, params)] for on, engine in engines.items()}
    assert runs[True] == runs[False]
    assert engines[True].steps_taken_from_ahead > MAX_TOKENS // 2  # most steps were launched ahead, and used


@pytest.mark.parametrize("control", list(CONTROLS))
def test_batch_invariant_alone_and_batched(tiny_llama_hf: tuple[LoadedModel, PreTrainedModel], control: str) -> None:
    loaded, _ = tiny_llama_hf
    prompts = prompts_for(loaded, 4)
    others = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), CONTROLS["repetition"]]
    alone = make_engine(loaded, STEPS[-1].name, batch_invariant=True).generate(prompts[:1], CONTROLS[control])
    batched = make_engine(loaded, STEPS[-1].name, batch_invariant=True, max_num_batched_tokens=16).generate(
        prompts, [CONTROLS[control], *others])
    assert batched[0].token_ids == alone[0].token_ids
