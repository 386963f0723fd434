"""SamplingParams validation and the batched, seeded Gumbel-max sampler."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.sampling import LogitControls, Sampler, SamplingParams, gumbel_noise

VOCAB = 1000


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(rows, vocab, generator=generator)


def sample_positions(logits_row: torch.Tensor, params: SamplingParams, positions: range) -> torch.Tensor:
    """Sample the same logits at many output positions (the randomness axis), one batch row each."""
    logits = logits_row.expand(len(positions), -1).contiguous()
    return Sampler()(logits, [params] * len(positions), list(positions))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict, field: str) -> None:
    """Each invalid setting raises ValueError whose message names the offending field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_params_normalise() -> None:
    """A lone stop string becomes a list; a missing seed is filled in; temperature 0 means greedy."""
    params = SamplingParams(stop="END", top_p=1.0, top_k=0)
    assert params.stop == ["END"]
    assert isinstance(params.seed, int)
    assert params.greedy and not SamplingParams(temperature=0.7).greedy


def test_greedy_rows_take_the_argmax() -> None:
    """Greedy rows return the argmax, alone and in a batch mixed with sampled rows."""
    logits = random_logits(6)
    greedy = [SamplingParams()] * 6
    assert torch.equal(Sampler()(logits, greedy, [0] * 6), logits.argmax(-1))
    mixed = [SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i) for i in range(6)]
    out = Sampler()(logits, mixed, [0] * 6)
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


def test_same_seed_and_position_give_the_same_token() -> None:
    """Sampling is a pure function of (logits, seed, position): repeating it repeats every token."""
    logits = random_logits(1, scale=0.5)[0]
    params = SamplingParams(temperature=1.0, seed=1234)
    first = sample_positions(logits, params, range(300))
    again = sample_positions(logits, SamplingParams(temperature=1.0, seed=1234), range(300))
    assert torch.equal(first, again)
    assert len(set(first.tolist())) > 50  # positions do vary the draw: this is not a constant


def test_different_seeds_give_different_draws() -> None:
    """Two seeds on a flat distribution disagree at most positions."""
    logits = torch.zeros(VOCAB)
    a = sample_positions(logits, SamplingParams(temperature=1.0, seed=1), range(300))
    b = sample_positions(logits, SamplingParams(temperature=1.0, seed=2), range(300))
    assert (a != b).float().mean().item() > 0.9


def test_a_rows_sample_does_not_depend_on_its_batch() -> None:
    """A request's token is the same alone and in any batch (other rows with their own seeds and cuts)."""
    logits = random_logits(5, scale=1.0)
    params = [
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=1.3, seed=8, top_k=50),
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=9, top_p=0.5),
        SamplingParams(temperature=0.5, seed=7),
    ]
    for position in range(20):
        positions = [position, position + 3, 0, position * 2, position]
        batched = Sampler()(logits, params, positions)
        alone = [Sampler()(logits[i : i + 1], [params[i]], [positions[i]]).item() for i in range(5)]
        assert batched.tolist() == alone
        reordered = Sampler()(logits.flip(0), params[::-1], positions[::-1])
        assert reordered.flip(0).tolist() == alone


def test_top_k_one_is_greedy() -> None:
    """top_k=1 leaves only the best token, whatever the seed or temperature."""
    logits = random_logits(8, scale=0.3)
    for seed in range(25):
        params = [SamplingParams(temperature=2.0, top_k=1, seed=seed)] * 8
        assert torch.equal(Sampler()(logits, params, list(range(8))), logits.argmax(-1))


def test_top_k_restricts_to_the_k_best() -> None:
    """Over many draws, top_k=5 samples only the 5 highest logits (and does sample more than one)."""
    # Nearly flat: without the cut, draws would spread widely. A small vocabulary keeps this sweep clear of
    # the infinite-noise bug that test_gumbel_noise_is_finite reproduces.
    logits = random_logits(1, vocab=64, scale=0.2)[0]
    allowed = set(logits.topk(5).indices.tolist())
    seen: set[int] = set()
    for seed in range(10):
        seen |= set(sample_positions(logits, SamplingParams(temperature=1.0, top_k=5, seed=seed), range(100)).tolist())
    assert seen <= allowed
    assert len(seen) == 5


def test_top_p_restricts_to_the_nucleus() -> None:
    """With probabilities 0.5, 0.3, 0.1, ... top_p=0.7 keeps exactly the first two tokens."""
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    logits = probs.log()
    draws = torch.cat(
        [sample_positions(logits, SamplingParams(temperature=1.0, top_p=0.7, seed=s), range(200)) for s in range(5)]
    )
    assert set(draws.tolist()) == {0, 1}
    share = (draws == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.05  # renormalised within the nucleus
    wide = sample_positions(logits, SamplingParams(temperature=1.0, seed=0), range(1000))
    assert set(wide.tolist()) > {0, 1}  # the same seeds without top_p do reach outside it


def test_tiny_top_p_keeps_only_the_best_token() -> None:
    """A top_p below the best token's probability reduces sampling to greedy."""
    logits = random_logits(4, scale=0.5)
    params = [SamplingParams(temperature=1.0, top_p=1e-6, seed=s) for s in range(4)]
    assert torch.equal(Sampler()(logits, params, [5, 6, 7, 8]), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_distribution_matches_softmax(temperature: float) -> None:
    """20000 Gumbel-max draws over positions reproduce softmax(logits / temperature) within 1.5 points."""
    logits = torch.tensor([1.0, 0.5, -0.5, 0.2])
    n = 20000
    draws = sample_positions(logits, SamplingParams(temperature=temperature, seed=42), range(n))
    freq = torch.bincount(draws, minlength=4).float() / n
    expected = (logits / temperature).softmax(-1)
    assert (freq - expected).abs().max().item() < 0.015, (freq, expected)


# Regression: gumbel_noise once built `uniform` from 24 bits in float32, where (2**24 - 1) + 0.5 rounds to 2**24,
# so one hash value in 2**24 gave uniform == 1.0 and +inf noise: that token won whatever its logit (NaN after a
# -inf top-k/top-p cut, which argmax also picks), about 0.3% of draws over a 49152-token vocabulary.


def test_gumbel_noise_is_finite_for_all_hash_values() -> None:
    """Noise for the largest 24-bit hash value must be finite (uniform strictly below 1)."""
    # (seed 8, position 29, vocab index 768) hashes to the largest value: it once gave uniform == 1.0.
    noise = gumbel_noise(torch.tensor([8]), torch.tensor([29]), 1000)
    assert torch.isfinite(noise).all(), f"infinite noise at vocab index {torch.isinf(noise).nonzero()[:, 1].tolist()}"


def test_top_k_never_samples_a_cut_token_even_at_the_worst_hash() -> None:
    """The cut holds where the noise is largest: a -inf (cut) logit plus noise never wins the argmax."""
    logits = random_logits(1, scale=0.2)[0]
    allowed = set(logits.topk(5).indices.tolist())
    token = Sampler()(logits[None], [SamplingParams(temperature=1.0, top_k=5, seed=8)], [29]).item()
    assert token in allowed


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ],
)
def test_invalid_controls_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_penalties_and_bias_change_one_row_as_defined() -> None:
    """The sampler's transform of a row, against a hand computation; the other rows of the batch are untouched."""
    logits = random_logits(3, vocab=10)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias={7: 3.0})
    prompt, output = [1, 2], [2, 3, 3]
    expected = logits[1].clone()
    expected[7] += 3.0
    for token in (1, 2, 3):
        expected[token] = expected[token] / 2 if expected[token] > 0 else expected[token] * 2
    expected[2] -= 1 * 0.25 + 0.5
    expected[3] -= 2 * 0.25 + 0.5
    rows = [SamplingParams(), params, SamplingParams()]
    for token in range(10):  # a bias of +100 on each token in turn shows where the argmax of the changed row lies
        biased = dataclasses.replace(params, logit_bias={**params.logit_bias, token: params.logit_bias.get(token, 0)})
        got = Sampler()(logits, [rows[0], biased, rows[2]], [0, 3, 0], [[], prompt, []], [[], output, []])
        assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()
        assert got[1] == expected.argmax()
    controls = LogitControls.build(rows, [[], prompt, []], [[], output, []], 10, torch.device("cpu"))
    changed = controls.apply(logits)
    assert torch.equal(changed[0], logits[0]) and torch.equal(changed[2], logits[2])
    torch.testing.assert_close(changed[1], expected)


def test_min_p_draws_only_from_the_allowed_set_and_keeps_greedy() -> None:
    """Seeded draws with min_p are the draws from the logits with the disallowed tokens removed by hand."""
    row = random_logits(1, seed=3, scale=1.0)[0]
    params = SamplingParams(temperature=1.3, min_p=0.2, seed=11)
    probs = (row / 1.3).softmax(-1)
    masked = row.masked_fill(probs < 0.2 * probs.max(), float("-inf"))
    drawn = sample_positions(row, params, range(200))
    assert torch.equal(drawn, sample_positions(masked, dataclasses.replace(params, min_p=0.0), range(200)))
    assert set(drawn.tolist()) <= set(torch.nonzero(masked > float("-inf")).flatten().tolist())
    assert len(set(drawn.tolist())) > 1 and bool((masked == float("-inf")).any())
    greedy = SamplingParams(min_p=0.9)
    assert Sampler()(row[None], [greedy], [0])[0] == row.argmax()
