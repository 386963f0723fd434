"""Checking proposals against the target model: which guesses to keep, and the token after them.

A verification row holds a request's last token and its k proposals d_1..d_k; one forward gives the target's
distributions p_1..p_{k+1} at those k + 1 positions (p_i is for the token after d_{i-1}).

- Greedy: keep proposals while each equals the target's argmax; the argmax after the last kept one is the
  step's extra token. The output is exactly what plain greedy decoding gives.
- Sampling (Leviathan et al. 2023; Chen et al. 2023): keep d_i with probability min(1, p_i(d_i) / q_i(d_i)), q_i
  the proposer's distribution (one-hot for a proposer that just names a token); at the first rejection, draw
  from max(0, p_i - q_i), renormalized; if every proposal is kept, draw the extra token from p_{k+1}. Each
  emitted token is then distributed as the target alone would draw it. The random numbers are a pure function
  of the request's seed and the output position (`common.sampling.uniform_noise`), so a seeded request draws
  the same numbers however it is batched; with no proposal the draw is exactly plain sampling's.
"""

from __future__ import annotations

import torch

from common.sampling import SamplingTensors, gumbel_noise, min_p_cut, top_k_top_p, uniform_noise

# Acceptance tests draw from another stream than the Gumbel noise of the same (seed, position).
ACCEPT_STREAM = 0x5BD1E995


def accept_greedy(proposals: list[int], target_tokens: list[int]) -> list[int]:
    """The tokens a greedy verification emits: the target's argmax at each of the k + 1 positions
    (`target_tokens`) for as long as the proposals agree with it, then the first argmax they missed (or the
    one after all k)."""
    kept = 0
    while kept < len(proposals) and proposals[kept] == target_tokens[kept]:
        kept += 1
    return target_tokens[: kept + 1]


def target_probabilities(logits: torch.Tensor, rows: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from: temperature, then min-p, top-k and top-p, then softmax. `logits` is
    [rows, positions, vocab]; `rows` holds one entry per row (its positions share its parameters)."""
    scaled = logits / rows.temperature[:, None, None]
    flat = scaled.flatten(0, 1)
    per_position = lambda t: t.repeat_interleave(logits.shape[1])  # noqa: E731
    flat = min_p_cut(flat, per_position(rows.min_p))
    return top_k_top_p(flat, per_position(rows.top_k), per_position(rows.top_p)).softmax(-1).view_as(logits)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to draw from after a rejection: the target's mass the proposer did not already cover,
    max(0, p - q), unnormalized. (Where p <= q everywhere nothing is left; a rejection cannot happen there,
    but rounding can: then p itself.)"""
    residual = (p - q).clamp(min=0)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)


def draw(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row from unnormalized `weights` [rows, vocab], by Gumbel-max with the request's noise at
    that output position: with softmax probabilities this is exactly `common.sampling.sample_rows`'s draw."""
    return (weights.log() + gumbel_noise(seeds, positions, weights.shape[-1])).argmax(-1)


def rejection_sample(target: torch.Tensor, draft: torch.Tensor | None, proposals: torch.Tensor,
                     num_proposals: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of rows by rejection sampling.

    target: [rows, K + 1, vocab] probabilities p_1..p_{K+1}; draft: [rows, K, vocab] probabilities q_1..q_K,
    or None when each proposal was named outright (one-hot q); proposals: [rows, K] token ids, of which the
    first `num_proposals[r]` count in row r; seeds, positions: [rows], the request's seed and the output
    position of the row's first new token. Returns tokens [rows, K + 1] and how many of them each row emits
    (1 to num_proposals + 1): the kept proposals, then one drawn token.
    """
    rows, k = proposals.shape
    vocab = target.shape[-1]
    if k == 0:  # nothing proposed: plain sampling from p_1
        return draw(target[:, 0], seeds, positions)[:, None], torch.ones_like(num_proposals)
    if draft is None:
        draft = torch.nn.functional.one_hot(proposals, vocab).to(target.dtype)
    steps = torch.arange(k, device=proposals.device)
    p_at = target[:, :k].gather(-1, proposals[..., None]).squeeze(-1)
    q_at = draft.gather(-1, proposals[..., None]).squeeze(-1)
    accept_u = torch.stack([uniform_noise(seeds ^ ACCEPT_STREAM, positions + i, 1)[:, 0] for i in range(k)], 1)
    kept_each = (accept_u * q_at < p_at) & (steps[None, :] < num_proposals[:, None])  # u < p / q, without dividing
    kept = kept_each.long().cumprod(-1).sum(-1)  # proposals kept before the first rejection
    at = kept[:, None, None].expand(rows, 1, vocab)
    p_next = target.gather(1, at).squeeze(1)
    q_next = draft.gather(1, at.clamp(max=k - 1)).squeeze(1)
    rejected = (kept < num_proposals)[:, None]
    weights = torch.where(rejected, residual_distribution(p_next, q_next), p_next)
    last = draw(weights, seeds, positions + kept)
    tokens = torch.cat([proposals, torch.zeros_like(proposals[:, :1])], 1)
    tokens.scatter_(1, kept[:, None], last[:, None])
    return tokens, kept + 1
