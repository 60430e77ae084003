"""The sampler's logit adjustments and log-probabilities, against their formulas on hand-made logits."""

import pytest
import torch

from server.engine.penalties import PenaltyState
from server.engine.sampler import (SamplingRows, apply_logit_bias, apply_presence_frequency, count_generated,
                                   sample)


def rows(n, **kw) -> SamplingRows:
    base = dict(temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, repetition_penalty=[1.0] * n,
                seeds=list(range(n)), positions=[0] * n, history=None)
    base.update(kw)
    return SamplingRows(**base)


def index(values):
    return torch.tensor(values, dtype=torch.int64)


def test_logit_bias_adds_each_tokens_bias_to_its_logit():
    vocab = 7
    state = PenaltyState(vocab, torch.device("cpu"))
    a = state.acquire(0.0, 0.0, ((1, 2.5), (6, -100.0)))
    b = state.acquire(0.0, 0.0, ((0, 100.0),))
    logits = torch.randn(3, vocab, dtype=torch.float64).float()
    before = logits.clone().double()
    apply_logit_bias(logits, index([0, 2]), index([a, b]), state)
    expected = before.clone()
    expected[0, 1] += 2.5
    expected[0, 6] -= 100.0
    expected[2, 0] += 100.0
    assert torch.allclose(logits.double(), expected, atol=1e-5)


def test_presence_and_frequency_penalties_follow_openais_formula():
    vocab = 6
    state = PenaltyState(vocab, torch.device("cpu"))
    row = state.acquire(0.7, 0.3, ())
    counts = torch.tensor([0, 1, 3, 0, 2, 0], dtype=torch.float32)
    state.counts[row] = counts
    logits = torch.randn(2, vocab)
    before = logits.clone().double()
    apply_presence_frequency(logits, index([1]), index([row]), state)
    c = counts.double()
    expected = before.clone()
    expected[1] = before[1] - c * 0.3 - (c > 0).double() * 0.7
    assert torch.allclose(logits.double(), expected, atol=1e-6)
    assert torch.equal(logits[0].double(), before[0])          # a row without a state row is untouched


def test_generated_tokens_are_counted_on_the_device():
    state = PenaltyState(5, torch.device("cpu"))
    r0, r1 = state.acquire(1.0, 0.0, ()), state.acquire(0.0, 1.0, ())
    for ids in ([3, 4, 1], [3, 0, 1], [2, 0, 1]):
        count_generated(torch.tensor(ids), index([0, 2]), index([r0, r1]), state)
    assert state.counts[r0].tolist() == [0, 0, 1, 2, 0]
    assert state.counts[r1].tolist() == [0, 3, 0, 0, 0]


def test_released_rows_are_reused_with_their_counts_and_bias_cleared():
    state = PenaltyState(4, torch.device("cpu"))
    held = [state.acquire(0.0, 0.5, ((2, 1.0),)) for _ in range(9)]       # past the first allocation
    assert state.rows >= 9 and state.rows_held == 9
    state.counts[held[3], 1] = 5
    state.release(held[3])
    again = state.acquire(0.1, 0.0, ())
    assert again == held[3]
    assert state.counts[again].abs().sum() == 0 and state.bias[again].abs().sum() == 0
    assert state.presence[again].item() == pytest.approx(0.1) and state.frequency[again].item() == 0


def test_a_logit_bias_outside_the_vocabulary_is_refused():
    state = PenaltyState(4, torch.device("cpu"))
    with pytest.raises(ValueError, match="logit_bias token id 4 is outside the vocabulary"):
        state.acquire(0.0, 0.0, ((4, 1.0),))


def test_frequency_penalty_through_the_sampler_steers_greedy_decoding_away_from_repeats():
    state = PenaltyState(3, torch.device("cpu"))
    row = state.acquire(0.0, 0.6, ())
    logits = torch.tensor([[2.0, 1.5, -3.0]])
    r = rows(1, penalty_rows=[row])
    drawn = [sample(logits, r, state)[0].item() for _ in range(4)]
    # 2.0 vs 1.5: 0; 1.4 vs 1.5: 1; 1.4 vs 0.9: 0; 0.8 vs 0.9: 1
    assert drawn == [0, 1, 0, 1]
    assert state.counts[row].tolist() == [2, 2, 0]


def test_sampled_frequencies_follow_the_biased_and_penalised_distribution():
    vocab, n = 4, 6000
    state = PenaltyState(vocab, torch.device("cpu"))
    counts = torch.tensor([3.0, 0.0, 1.0, 0.0])
    penalty_rows = []
    for _ in range(n):
        row = state.acquire(0.4, 0.2, ((3, 1.2), (1, -0.5)))
        state.counts[row] = counts
        penalty_rows.append(row)
    logits = torch.tensor([1.0, 0.5, 0.2, -0.3]).expand(n, vocab).clone()
    ids = sample(logits, rows(n, temperature=[1.0] * n, seeds=list(range(n)), penalty_rows=penalty_rows), state)[0]
    adjusted = (torch.tensor([1.0, 0.5, 0.2, -0.3]).double() + torch.tensor([0, -0.5, 0, 1.2]).double()
                - 0.2 * counts.double() - 0.4 * (counts > 0).double())
    freq = torch.bincount(ids, minlength=vocab).double() / n
    assert (freq - adjusted.softmax(-1)).abs().max() < 0.025


def test_a_step_without_biases_or_penalties_leaves_the_state_alone():
    state = PenaltyState(50, torch.device("cpu"))
    row = state.acquire(1.0, 1.0, ((0, 5.0),))
    logits = torch.randn(3, 50)
    ids, _ = sample(logits, rows(3), state)
    assert torch.equal(ids, logits.argmax(-1))
    assert state.counts[row].abs().sum() == 0


def test_reported_logprobs_are_the_raw_distributions_whatever_the_sampling():
    torch.manual_seed(0)
    n, vocab = 5, 300
    state = PenaltyState(vocab, torch.device("cpu"))
    logits = torch.randn(n, vocab) * 3
    penalty_rows = [state.acquire(0.5, 0.5, ((7, 30.0),)), -1, -1, -1, state.acquire(0.0, 0.0, ((9, -5.0),))]
    asked = [3, -1, 0, 20, 5]
    r = rows(n, temperature=[0.7, 1.0, 0.0, 1.3, 0.0], top_k=[0, 5, 0, 0, 0], top_p=[1.0, 1.0, 1.0, 0.8, 1.0],
             repetition_penalty=[1.0, 1.0, 1.0, 1.2, 1.0], history=[[], [], [], [1, 2], []],
             logprobs=asked, penalty_rows=penalty_rows)
    ids, lp = sample(logits.clone(), r, state)
    reference = logits.double().log_softmax(-1)
    assert lp.rows == [0, 2, 3, 4]
    for j, i in enumerate(lp.rows):
        assert abs(lp.sampled[j].item() - reference[i, ids[i]].item()) < 1e-5
        k = asked[i]
        best = reference[i].topk(k)
        assert lp.top_ids[j, :k].tolist() == best.indices.tolist()
        assert torch.allclose(lp.top_logprobs[j, :k].double(), best.values, atol=1e-5)
    assert ids[2] == logits[2].argmax()                        # greedy, unbiased: the top token
    assert lp.sampled[1].item() == lp.top_logprobs[1, 0].item()
    assert ids[0] == 7                                         # a bias of 30 wins
