"""The log-probability of each prompt token given the ones before it: what `echo` with `logprobs` returns.

An engine's prefill computes logits at one row per request, its last token, and a step may not even compute
the whole prompt (a prefix-cache hit brings blocks of K and V, which hold no logits; chunked prefill spreads the
prompt over several steps). So a request that asks for its prompt's log-probabilities has its prompt scored by
a forward of its own, once, when its first token is drawn: the whole prompt through the same model, with plain
causal attention and no KV cache. Every path of the engine stays as it is; the price is one more prefill of
that prompt. The log-probabilities are those of the model itself: no temperature, penalty or bias applies to
text that was given, not drawn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model import CausalLM, ForwardContext
from common.sampling import TokenLogprob, largest

HEAD_ROWS = 256  # the head's rows computed at once: a whole prompt's float32 logits could outgrow the device


class WholePromptForward(ForwardContext):
    """One sequence, attended causally within itself: nothing is read from or written to a KV cache."""

    def __init__(self, num_tokens: int, device: torch.device) -> None:
        self.positions = torch.arange(num_tokens, device=device)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)


@torch.inference_mode()
def prompt_logprobs(model: CausalLM, prompt_ids: list[int], top: int) -> list[TokenLogprob | None]:
    """For each prompt token, its log-probability given the tokens before it and the `top` most likely tokens
    there; None for the first token, which nothing comes before."""
    ids = torch.tensor(prompt_ids, device=model.device)
    hidden = model(ids, WholePromptForward(len(prompt_ids), model.device))[:-1]  # the last row predicts no prompt
    scored: list[TokenLogprob | None] = [None]
    for start in range(0, hidden.shape[0], HEAD_ROWS):
        logprobs = model.compute_logits(hidden[start : start + HEAD_ROWS]).log_softmax(dim=-1)
        following = ids[start + 1 : start + 1 + logprobs.shape[0]]
        chosen = logprobs.gather(-1, following[:, None])[:, 0].tolist()
        top_values, top_ids = largest(logprobs, top)
        for token_id, logprob, values, alternatives in zip(following.tolist(), chosen, top_values.tolist(),
                                                           top_ids.tolist(), strict=True):
            scored.append(TokenLogprob(token_id, logprob, list(zip(alternatives, values, strict=True))))
    return scored
