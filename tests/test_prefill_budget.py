"""The CPU's prefill budget by time (``server/engine/prefill_budget.py`` and the scheduler's use
of it): a long prompt's chunks fit the step time and alternate with decode steps."""

import random

import pytest

from server.engine.block_manager import BlockManager
from server.engine.params import SamplingParams
from server.engine.prefill_budget import PROBE_TOKENS, PrefillCost, measure
from server.engine.scheduler import DecodeStep, PrefillStep, Scheduler
from server.engine.sequence import Sequence


@pytest.mark.parametrize("seed", range(5))
def test_tokens_within_is_the_most_that_fit(seed):
    rng = random.Random(seed)
    cost = PrefillCost(rng.uniform(1e-4, 1e-2), rng.choice([0.0, rng.uniform(1e-8, 1e-5)]))
    for _ in range(50):
        seconds, context = rng.uniform(0.01, 2.0), rng.randrange(0, 8192)
        n = cost.tokens_within(seconds, context)
        assert cost.seconds(n, context) <= seconds * (1 + 1e-12)
        assert cost.seconds(n + 1, context) > seconds


def test_measure_recovers_a_per_token_and_a_per_key_cost():
    true = PrefillCost(3e-3, 2e-6)
    calls = []

    def prefill_seconds(tokens, context):
        calls.append((tokens, context))
        return true.seconds(tokens, context)

    fitted = measure(prefill_seconds, kv_tokens=8192)
    assert fitted.per_token_s == pytest.approx(true.per_token_s) and fitted.per_key_s == pytest.approx(true.per_key_s)
    assert {t for t, _ in calls} == {PROBE_TOKENS} and {c for _, c in calls} == {0, 2048}
    small = measure(prefill_seconds, kv_tokens=PROBE_TOKENS)          # no room for a context: projections only
    assert small.per_key_s == 0.0
    calls.clear()
    measure(prefill_seconds, kv_tokens=40)                            # a pool smaller than the probe
    assert set(calls) == {(40, 0)}


def decode_all(sched, step):
    for s, take in step.chunks:
        s.num_cached += take
        if s.prefill_remaining == 0:
            sched.prefill_done(s)


def test_a_long_prompt_is_cut_by_time_and_alternates_with_decode_steps():
    cost = PrefillCost(per_token_s=2e-3, per_key_s=1e-6)
    step_s = 0.2
    sched = Scheduler(BlockManager(512, 16), max_batch=8, max_prefill_tokens=4096, max_model_len=8192,
                      chained_prefill_tokens=1024, prefill_cost=cost, prefill_step_s=step_s)
    stream = Sequence("stream", [5, 6, 7], SamplingParams(max_new_tokens=1000), seed=0)
    sched.add(stream)
    decode_all(sched, sched.schedule())
    long = Sequence("long", list(range(4000)), SamplingParams(max_new_tokens=4), seed=0)
    sched.add(long)
    kinds, takes = [], []
    while long.status.name != "RUNNING":
        step = sched.schedule()
        kinds.append(type(step).__name__)
        if isinstance(step, PrefillStep):
            ((seq, take),) = step.chunks
            assert cost.seconds(take, seq.num_cached) <= step_s
            assert take == seq.prefill_remaining or cost.seconds(take + 1, seq.num_cached) > step_s
            takes.append(take)
            decode_all(sched, step)
    assert sum(takes) == 4000 and len(takes) > 4000 * cost.per_token_s / step_s
    assert takes[0] > takes[-2], "chunks shrink as the context grows"
    assert all(a != b or a == "DecodeStep" for a, b in zip(kinds, kinds[1:])), kinds   # never two prefills in a row


def test_a_step_slower_than_the_budget_still_advances():
    sched = Scheduler(BlockManager(64, 16), max_batch=4, max_prefill_tokens=4096, max_model_len=1024,
                      prefill_cost=PrefillCost(per_token_s=1.0, per_key_s=0.0), prefill_step_s=0.2)
    seq = Sequence("slow", list(range(40)), SamplingParams(max_new_tokens=4), seed=0)
    sched.add(seq)
    takes = []
    while seq.prefill_remaining:
        step = sched.schedule()
        takes += [take for _, take in step.chunks]
        decode_all(sched, step)
    assert takes == [16, 16, 8]


def test_without_a_cost_the_token_budget_alone_decides():
    sched = Scheduler(BlockManager(512, 16), max_batch=8, max_prefill_tokens=4096, max_model_len=8192)
    seq = Sequence("long", list(range(4000)), SamplingParams(max_new_tokens=4), seed=0)
    sched.add(seq)
    step = sched.schedule()
    assert isinstance(step, PrefillStep) and step.chunks == [(seq, 4000)]
    assert not isinstance(step, DecodeStep)
