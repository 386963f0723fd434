"""Step 11's pieces on their own: the n-gram proposer, greedy acceptance, and the rejection sampler, whose
emitted tokens must follow the target's distribution exactly (a chi-square test that a wrong rule fails)."""

from __future__ import annotations

import pytest
import torch

from common.sampling import SamplingParams, SamplingTensors, sample_rows
from step11_speculative_decoding import verify
from step11_speculative_decoding.proposers import NgramProposer
from step11_speculative_decoding.verify import accept_greedy, rejection_sample, target_probabilities


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),  # the 3-token suffix occurred at the start
    ([5, 6, 1, 2, 7, 1, 2], 3, [7, 1, 2]),  # no earlier [7, 1, 2]; [1, 2] did, latest at 2
    ([1, 2, 9, 1, 2, 8, 1, 2], 2, [8, 1]),  # two earlier [1, 2]: the latest one's continuation
    ([4, 4, 4, 4], 5, [4]),  # [4, 4, 4] occurs at 0, and one token follows it there
    ([1, 2, 3], 4, []),  # nothing repeats
    ([7], 4, []),
])
def test_ngram_proposals(tokens: list[int], k: int, expected: list[int]) -> None:
    assert NgramProposer(k).propose(tokens) == expected


def test_ngram_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="--speculative-tokens must be at least 1"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(2, max_n=1, min_n=2)


@pytest.mark.parametrize("proposals, target, emitted", [
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all kept, plus the token after them
    ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # the second differs: the target's token replaces it, and the rest go
    ([5], [4, 3], [4]),
    ([], [4], [4]),
])
def test_greedy_acceptance(proposals: list[int], target: list[int], emitted: list[int]) -> None:
    assert accept_greedy(proposals, target) == emitted


def test_no_proposal_draws_exactly_what_plain_sampling_draws() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 1, 50)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=s) for s in range(64)]
    rows = SamplingTensors.build(params, list(range(64)), 50, torch.device("cpu"))
    tokens, emitted = rejection_sample(target_probabilities(logits, rows), None, torch.zeros(64, 0, dtype=torch.long),
                                       torch.zeros(64, dtype=torch.long), rows.seeds, rows.positions)
    assert emitted.tolist() == [1] * 64
    assert tokens[:, 0].tolist() == sample_rows(logits[:, 0], rows).tolist()


# A target and a draft over 6 tokens that disagree: the draft over-proposes tokens the target finds unlikely.
P = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
                  [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]], dtype=torch.float64)
Q = torch.tensor([[0.05, 0.05, 0.10, 0.30, 0.30, 0.20],
                  [0.40, 0.30, 0.10, 0.10, 0.05, 0.05]], dtype=torch.float64)
TRIALS = 30_000


def first_two_tokens(draft: torch.Tensor | None, proposals: torch.Tensor) -> torch.Tensor:
    """Each trial's first two tokens: the verification's, completed where it emitted one (a rejection at the
    first proposal) by what the next step would draw, from the target at the second position."""
    target = P[None].expand(TRIALS, -1, -1).float()
    seeds = torch.arange(TRIALS)
    tokens, emitted = rejection_sample(target, draft, proposals, torch.full((TRIALS,), 2), seeds,
                                       torch.zeros(TRIALS, dtype=torch.long))
    next_step = verify.draw(target[:, 1], seeds + 10**6, torch.ones(TRIALS, dtype=torch.long))
    second = torch.where(emitted >= 2, tokens[:, 1], next_step)
    return torch.stack([tokens[:, 0], second], 1)


def chi_square_p_value(pairs: torch.Tensor) -> float:
    """How likely counts this far from P[0] x P[1] would be if the pairs were drawn from it."""
    counts = torch.bincount(pairs[:, 0] * 6 + pairs[:, 1], minlength=36).double()
    expected = (P[0][:, None] * P[1][None, :]).flatten() * TRIALS
    statistic = ((counts - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor(35 / 2, dtype=torch.float64), statistic / 2).item()


def draft_proposals() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.stack([torch.multinomial(Q[i], TRIALS, replacement=True, generator=generator) for i in range(2)], 1)


def test_rejection_sampling_keeps_the_targets_distribution() -> None:
    draft = Q[None].expand(TRIALS, -1, -1).float()
    assert chi_square_p_value(first_two_tokens(draft, draft_proposals())) > 1e-3


def test_named_proposals_keep_the_targets_distribution() -> None:
    """A proposer that names its tokens (n-gram lookup: one-hot q), here always the same two."""
    proposals = torch.tensor([[3, 0]]).expand(TRIALS, -1)
    assert chi_square_p_value(first_two_tokens(None, proposals)) > 1e-3


def test_a_wrong_rule_fails_the_same_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing from p itself after a rejection (instead of max(0, p - q)) over-weights what the draft proposes:
    the check must see it, or it proves nothing."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    draft = Q[None].expand(TRIALS, -1, -1).float()
    assert chi_square_p_value(first_two_tokens(draft, draft_proposals())) < 1e-6
