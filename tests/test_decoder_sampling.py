"""Sampling: temperature, top-k, top-p, per-sequence seeds."""

from __future__ import annotations

import math

import pytest
import torch

from aserve.engines.decoder.sampling import adjust_logits, filtered_probs, make_generator, sample
from aserve.engines.decoder.sequence import Sequence
from aserve.errors import InvalidArgument
from aserve.types.generation import SamplingParams


def _filter(
    logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> dict[int, float]:
    probs, ids = filtered_probs(
        torch.tensor([logits]),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
    )
    return {int(i): float(p) for i, p in zip(ids[0], probs[0], strict=True) if p > 0}


def _seqs(
    params: list[SamplingParams], gens: list[torch.Generator] | None = None,
    prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
    stops: frozenset[int] = frozenset(),
) -> list[Sequence]:  # fmt: skip
    """Engine sequences as the sampler sees them: settings, generator, tokens so far."""
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(f"r{i}", list(prompts[i] if prompts else [0]), p, 64, stops)
        seq.generator = gens[i] if gens else make_generator(0)
        seq.output_ids = list(outputs[i]) if outputs else []
        seqs.append(seq)
    return seqs


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]
) -> list[int]:
    return sample(logits, _seqs(params, gens))


LOGITS = [math.log(p) for p in (0.05, 0.5, 0.15, 0.3)]  # token 1 > 3 > 2 > 0


def test_temperature_one_keeps_the_distribution() -> None:
    kept = _filter(LOGITS)
    assert kept == pytest.approx({1: 0.5, 3: 0.3, 2: 0.15, 0: 0.05})


def test_temperature_sharpens_and_flattens() -> None:
    cold, hot = _filter(LOGITS, temperature=0.5), _filter(LOGITS, temperature=2.0)
    assert cold[1] > 0.5 > hot[1]
    want = torch.softmax(torch.tensor(LOGITS) / 0.5, -1)
    assert cold == pytest.approx({i: float(want[i]) for i in range(4)})


def test_top_k_keeps_the_k_most_likely_renormalized() -> None:
    assert _filter(LOGITS, top_k=2) == pytest.approx({1: 0.5 / 0.8, 3: 0.3 / 0.8})
    assert _filter(LOGITS, top_k=1) == {1: 1.0}
    assert len(_filter(LOGITS, top_k=10)) == 4  # k over the vocabulary: no limit


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    assert set(_filter(LOGITS, top_p=0.8)) == {1, 3}  # 0.5 + 0.3 reaches 0.8
    assert set(_filter(LOGITS, top_p=0.81)) == {1, 3, 2}
    assert set(_filter(LOGITS, top_p=0.1)) == {1}  # the most likely token always stays
    assert _filter(LOGITS, top_p=0.95) == pytest.approx(
        {1: 0.5 / 0.95, 3: 0.3 / 0.95, 2: 0.15 / 0.95}
    )


def test_top_k_applies_before_top_p() -> None:
    # After top-k=2 the two are 0.625 / 0.375: top_p 0.6 then keeps only the first.
    assert set(_filter(LOGITS, top_k=2, top_p=0.6)) == {1}


def test_rows_are_filtered_independently() -> None:
    logits = torch.tensor([LOGITS, LOGITS, LOGITS])
    probs, ids = filtered_probs(
        logits,
        torch.tensor([1.0, 1.0, 1.0]),
        torch.tensor([0, 2, 0]),
        torch.tensor([1.0, 1.0, 0.8]),
    )
    kept = [{int(i) for i, p in zip(ids[r], probs[r], strict=True) if p > 0} for r in range(3)]
    assert kept == [{0, 1, 2, 3}, {1, 3}, {1, 3}]


def test_samples_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([LOGITS])
    params = [SamplingParams(temperature=1.0, top_k=3)]
    gen = make_generator(0)
    counts = {0: 0, 1: 0, 2: 0, 3: 0}
    n = 4000
    for _ in range(n):
        counts[_sample(logits, params, [gen])[0]] += 1
    assert counts[0] == 0  # filtered out by top-k
    for token, p in ((1, 0.5 / 0.95), (3, 0.3 / 0.95), (2, 0.15 / 0.95)):
        assert abs(counts[token] / n - p) < 0.03, counts


def test_greedy_is_argmax_and_draws_no_randomness() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    gens = [make_generator(5) for _ in range(3)]
    before = [g.get_state() for g in gens]
    tokens = _sample(logits, [SamplingParams(temperature=0)] * 3, gens)
    assert tokens == logits.argmax(-1).tolist()
    assert all(torch.equal(g.get_state(), b) for g, b in zip(gens, before, strict=True))


def test_seeded_rows_do_not_depend_on_their_batch() -> None:
    vocab = 200
    rng = torch.Generator().manual_seed(2)
    steps = [torch.randn(4, vocab, generator=rng) for _ in range(20)]
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=7)

    alone_gen = make_generator(7)
    alone = [_sample(s[2:3], [mine], [alone_gen])[0] for s in steps]

    others = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(top_k=5),
    ]
    gens = [make_generator(1), make_generator(None), make_generator(7), make_generator(3)]
    params = [others[0], others[1], mine, others[2]]
    batched = [_sample(s, params, gens)[2] for s in steps]
    assert batched == alone
    assert len(set(alone)) > 5  # really sampling, not a constant


def test_unseeded_sequences_differ() -> None:
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(temperature=1.0)]
    a, b = make_generator(None), make_generator(None)
    assert [_sample(logits, params, [a])[0] for _ in range(8)] != [
        _sample(logits, params, [b])[0] for _ in range(8)
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"stop": ("",)}, "stop strings must not be empty"),
        ({"seed": -3}, "seed must be in"),
    ],
)
def test_params_are_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        SamplingParams(**kwargs)


# --- penalties, logit_bias, min_tokens (adjust_logits) ---------------------------------


def test_logits_no_setting_asks_to_change_are_left_as_they_are() -> None:
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    assert adjust_logits(logits, _seqs([SamplingParams(), SamplingParams(top_k=3)])) is logits


def test_min_tokens_keeps_end_tokens_out_of_reach_until_it_is_reached() -> None:
    logits = torch.zeros(2, 6)
    logits[:, 5] = 10.0  # the end token would win
    seqs = _seqs(
        [SamplingParams(temperature=0, min_tokens=2)] * 2,
        outputs=[[1], [1, 2]],
        stops=frozenset({5, 99}),
    )  # fmt: skip  (99: outside the vocabulary, skipped)
    out = adjust_logits(logits, seqs)
    assert out[0, 5] == float("-inf") and out[1, 5] == 10.0
    assert torch.equal(out[0, :5], logits[0, :5])
    assert sample(logits, seqs) == [0, 5]


def test_logit_bias_is_added_and_can_force_a_token_greedily() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]] * 2)
    biased = SamplingParams(temperature=0, logit_bias=((0, 100.0), (2, -100.0)))
    seqs = _seqs([biased, SamplingParams(temperature=0)])
    out = adjust_logits(logits, seqs)
    assert out[0].tolist() == [101.0, 2.0, -97.0, 0.5]
    assert torch.equal(out[1], logits[1])  # its neighbour in the batch is untouched
    assert sample(logits, seqs) == [0, 2]


def test_repetition_penalty_scales_the_tokens_of_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 4.0]])
    p = SamplingParams(repetition_penalty=2.0)
    out = adjust_logits(logits, _seqs([p], prompts=[[0]], outputs=[[1]]))
    # Tokens 0 (prompt) and 1 (output): positive halved, negative doubled; 2-4 unseen.
    assert out[0].tolist() == [1.0, -4.0, 2.0, -2.0, 4.0]


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    logits = torch.zeros(1, 4)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = adjust_logits(logits, _seqs([p], prompts=[[3, 3, 3]], outputs=[[1, 1, 1, 2]]))
    assert out[0].tolist() == [0.0, -(1.5 + 1.0), -(0.5 + 1.0), 0.0]


def test_a_greedy_frequency_penalty_keeps_a_token_from_winning_again() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert sample(logits, _seqs([p], outputs=[[]])) == [0]
    assert sample(logits, _seqs([p], outputs=[[0]])) == [1]  # 3 - 1 < 2.5
