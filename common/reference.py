"""Hugging Face transformers as the oracle: the same weights, run by a model we did not write.

Used by tests and `--dry-run`/default runs to check our outputs, and by benchmarks as the baseline.
Never used as the engine's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from common.loading import LoadedModel


def hf_model_for(loaded: LoadedModel) -> PreTrainedModel:
    """A transformers model with the same weights as `loaded`.

    A checkpoint folder is loaded by transformers itself, independently of our loader. Generated random
    weights are shared with our model (no copy), so a 7B oracle costs no extra device memory.
    """
    model = loaded.model
    if loaded.source_dir is not None:
        hf = AutoModelForCausalLM.from_pretrained(str(loaded.source_dir), dtype=model.dtype)
        return hf.to(model.device).eval()
    hf_config = AutoConfig.for_model(**model.config.to_hf())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=model.dtype)
    hf.load_state_dict(model.state_dict(), strict=True, assign=True)
    hf.tie_weights()
    # Buffers built on the meta device hold nothing: rebuild the rotary table on the real device.
    rotary = hf.model.rotary_emb
    with torch.device(model.device):
        hf.model.rotary_emb = type(rotary)(config=hf_config)
    return hf.eval()


@torch.inference_mode()
def reference_logits(hf: PreTrainedModel, token_ids: Sequence[int]) -> torch.Tensor:
    """Float32 logits [len(token_ids), vocab] of one sequence."""
    input_ids = torch.tensor([list(token_ids)], device=hf.device)
    return hf(input_ids=input_ids).logits[0].float()


@torch.inference_mode()
def reference_greedy(
    hf: PreTrainedModel, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int]
) -> list[int]:
    """HF generate(), greedy, one prompt alone (no padding to perturb it). Returns the new token ids."""
    input_ids = torch.tensor([list(prompt_ids)], device=hf.device)
    eos = sorted(eos_token_ids) or None
    out = hf.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[0] if eos else 0,
        top_k=None,
        top_p=None,
        temperature=None,
    )
    return out[0, input_ids.shape[1] :].tolist()


@dataclass
class ParityReport:
    """How one of our greedy outputs compares with the reference's."""

    equal: bool
    diverge_at: int | None = None  # first differing output position
    ours: int | None = None  # our token there
    theirs: int | None = None  # the reference's token there
    logit_gap: float | None = None  # |logit(theirs) - logit(ours)| under the reference, at that point

    @property
    def near_tie(self) -> bool:
        """A divergence we accept: the two tokens are within 1e-4 in the reference's own logits."""
        return self.logit_gap is not None and self.logit_gap < 1e-4

    @property
    def ok(self) -> bool:
        return self.equal or self.near_tie

    def describe(self) -> str:
        if self.equal:
            return "identical"
        kind = "near-tie" if self.near_tie else "MISMATCH"
        return (
            f"{kind} at output token {self.diverge_at}: ours {self.ours}, reference {self.theirs}, "
            f"reference logit gap {self.logit_gap:.2e}"
        )


def compare_greedy(
    hf: PreTrainedModel, prompt_ids: Sequence[int], ours: Sequence[int], theirs: Sequence[int]
) -> ParityReport:
    """Compare two greedy continuations; at the first difference, measure whether it is a genuine tie."""
    if list(ours) == list(theirs):
        return ParityReport(equal=True)
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    if at >= min(len(ours), len(theirs)):  # one stopped earlier than the other: no tie to measure
        return ParityReport(equal=False, diverge_at=at, logit_gap=float("inf"))
    logits = reference_logits(hf, list(prompt_ids) + list(theirs[:at]))[-1]
    gap = (logits[theirs[at]] - logits[ours[at]]).abs().item()
    return ParityReport(False, at, ours[at], theirs[at], gap)
