"""Log-probabilities, choices of one prompt and logit adjustments through the engine, on the CPU in
float32, against a teacher-forced forward of transformers' own SDPA model with the same weights."""

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from models import load_model
from server.engine import Engine, EngineConfig, FinishEvent, SamplingParams

from .helpers import perturb_small_tensors

# fp32 paged attention against fp32 SDPA: the logits agree to about 1e-5 (test_model_equivalence's
# bound is 1e-4 on the real model); log-probabilities inherit that
LOGPROB_TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def tiny():
    loaded = load_model("random:tiny", dtype="float32", device="cpu")
    perturb_small_tensors(loaded.model, seed=3)
    return loaded


@pytest.fixture(scope="module")
def reference(tiny):
    model = AutoModelForCausalLM.from_config(tiny.model.config, attn_implementation="sdpa", dtype=torch.float32)
    model.load_state_dict(tiny.model.state_dict())
    return model.eval()


@pytest.fixture(scope="module")
def engine(tiny):
    engine = Engine(tiny, EngineConfig(max_batch=8, num_blocks=64, block_size=16))
    engine.start()
    yield engine
    engine.shutdown()


@torch.inference_mode()
def reference_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the float64 log-softmax of the logits predicting token i + 1."""
    return reference(torch.tensor([ids])).logits[0].double().log_softmax(-1)


async def events_of(stream, abort_after: int | None = None) -> tuple[list, FinishEvent]:
    tokens = []
    async for event in stream:
        if isinstance(event, FinishEvent):
            return tokens, event
        tokens.append(event)
        if abort_after is not None and len(tokens) == abort_after:
            stream.abort()


def run_choices(engine, prompt: list[int], params: SamplingParams, n: int, abort: dict | None = None):
    """n choices of one prompt added as the HTTP layer adds them; [(token events, finish)] per choice."""
    abort = abort or {}

    async def main():
        streams = [engine.add_request(prompt, params)]
        for _ in range(n - 1):
            streams.append(engine.add_request(prompt, params, follows=streams[0].request_id))
        return await asyncio.gather(*(events_of(s, abort.get(i)) for i, s in enumerate(streams)))
    return asyncio.run(main())


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(length)]


def pool_is_whole(engine) -> None:
    core = engine.core
    assert not core.busy()
    assert core.blocks.num_used == 0
    core.blocks.check([])
    assert core.runner.penalties.rows_held == 0


def test_generated_logprobs_are_a_float64_log_softmax_of_the_steps_logits(engine, reference):
    prompt = random_prompt(37, seed=1)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, seed=4, logprobs=True, top_logprobs=5,
                            ignore_eos=True, presence_penalty=0.5, logit_bias=((77, 3.0),))
    [(events, finish)] = run_choices(engine, prompt, params, 1)
    assert finish.reason == "length" and len(events) == 10
    ref = reference_logprobs(reference, prompt + [e.token_id for e in events])
    for j, event in enumerate(events):
        row = ref[len(prompt) - 1 + j]
        assert abs(event.logprob - row[event.token_id].item()) < LOGPROB_TOLERANCE
        best = row.topk(5)
        assert [i for i, _ in event.top_logprobs] == best.indices.tolist()
        assert max(abs(v - b) for (_, v), b in zip(event.top_logprobs, best.values.tolist())) < LOGPROB_TOLERANCE
        assert event.top_logprobs == sorted(event.top_logprobs, key=lambda p: -p[1])
    pool_is_whole(engine)


def test_greedy_tokens_are_the_top_logprob(engine):
    prompt = random_prompt(20, seed=2)
    params = SamplingParams(max_new_tokens=6, logprobs=True, top_logprobs=1, ignore_eos=True)
    [(events, _)] = run_choices(engine, prompt, params, 1)
    for event in events:
        assert event.top_logprobs[0] == (event.token_id, event.logprob)


@pytest.mark.parametrize("length", [5, 40, 700])          # one chunk, and several 512-token chunks
def test_prompt_logprobs_match_a_teacher_forced_forward(engine, reference, length):
    prompt = random_prompt(length, seed=length)
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=4, logprobs=True, ignore_eos=True)
    [(events, _)] = run_choices(engine, prompt, params, 1)
    got = events[0].prompt_logprobs
    assert len(got) == length - 1
    ref = reference_logprobs(reference, prompt)
    for i, (value, rank, best) in enumerate(got):
        assert abs(value - ref[i, prompt[i + 1]].item()) < LOGPROB_TOLERANCE
        assert rank == 1 + (ref[i] > ref[i, prompt[i + 1]] + LOGPROB_TOLERANCE).sum().item() or \
            abs(rank - 1 - (ref[i] > ref[i, prompt[i + 1]]).sum().item()) <= 2
        assert [t for t, _ in best] == ref[i].topk(4).indices.tolist()
    assert abs(events[0].logprob - ref[-1, events[0].token_id].item()) < LOGPROB_TOLERANCE
    assert events[0].cached_tokens == 0          # scored prompts are computed, not read from the cache
    pool_is_whole(engine)


def test_n_greedy_choices_are_identical_to_each_other_and_to_one_choice(engine):
    prompt = random_prompt(45, seed=5)                       # two full blocks and a tail of 13
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True)
    choices = run_choices(engine, prompt, params, 4)
    first = [e.token_id for e in choices[0][0]]
    assert all([e.token_id for e in c] == first for c, _ in choices)
    assert choices[0][0][0].cached_tokens == 0
    assert all(c[0].cached_tokens == 32 for c, _ in choices[1:])    # the prompt's two full blocks, shared
    assert len({c[0].time for c, _ in choices}) == 1          # every first token drawn from one prefill
    [(again, _)] = run_choices(engine, prompt, params, 1)
    assert [e.token_id for e in again] == first
    assert [e.logprob for e in again] == pytest.approx([e.logprob for e in choices[2][0]], abs=1e-5)
    pool_is_whole(engine)


def test_more_choices_than_batch_rows_all_finish(engine):
    """A prefill samples one row per choice drawing from it, and its read-back holds max_batch rows:
    the choices past that draw their first token from their own prefill instead."""
    prompt = random_prompt(45, seed=12)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    n = engine.core.scheduler.max_batch + 4
    choices = run_choices(engine, prompt, params, n)
    assert [f.reason for _, f in choices] == ["length"] * n
    first = [e.token_id for e in choices[0][0]]
    assert all([e.token_id for e in c] == first for c, _ in choices)
    pool_is_whole(engine)


def test_seeded_choices_differ_from_each_other_and_repeat_with_the_seed(engine):
    prompt = random_prompt(30, seed=6)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    # the HTTP layer gives each choice its own seed; the engine takes what it is given
    def seeded(n):
        async def main():
            streams = [engine.add_request(prompt, SamplingParams(**{**params.__dict__, "seed": 11 + 1000 * i}),
                                          follows=None) for i in range(n)]
            return await asyncio.gather(*(events_of(s) for s in streams))
        return [[e.token_id for e in events] for events, _ in asyncio.run(main())]
    a, b = seeded(3), seeded(3)
    assert a == b and len({tuple(t) for t in a}) == 3
    pool_is_whole(engine)


def test_every_block_returns_when_choices_are_aborted(engine):
    prompt = random_prompt(50, seed=7)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    choices = run_choices(engine, prompt, params, 4, abort={2: 3, 3: 1})
    assert [f.reason for _, f in choices] == ["length", "length", "abort", "abort"]
    pool_is_whole(engine)

    async def abort_while_held():
        leader = engine.add_request(prompt, params)
        held = engine.add_request(prompt, params, follows=leader.request_id)
        held.abort()                                   # before the leader's prefill: still held
        return await asyncio.gather(events_of(leader), events_of(held))
    (lead_events, lead_finish), (held_events, held_finish) = asyncio.run(abort_while_held())
    assert lead_finish.reason == "length" and held_finish.reason == "abort" and not held_events
    pool_is_whole(engine)

    async def abort_the_leader_first():
        leader = engine.add_request(prompt + [9], params)
        held = engine.add_request(prompt + [9], params, follows=leader.request_id)
        leader.abort()                                 # its choices go on without it
        return await asyncio.gather(events_of(leader), events_of(held))
    (_, lead_finish), (held_events, held_finish) = asyncio.run(abort_the_leader_first())
    assert lead_finish.reason == "abort" and held_finish.reason == "length" and len(held_events) == 20
    pool_is_whole(engine)


def test_a_logit_bias_of_100_forces_its_token_and_penalties_hold_no_row_after(engine):
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, logit_bias=((4242, 100.0),), frequency_penalty=0.1)
    [(events, _)] = run_choices(engine, random_prompt(12, seed=8), params, 1)
    assert [e.token_id for e in events] == [4242] * 5
    pool_is_whole(engine)


def test_frequency_penalty_changes_greedy_text_as_the_formula_says(engine, reference):
    prompt = random_prompt(16, seed=9)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5)
    [(events, _)] = run_choices(engine, prompt, params, 1)
    tokens = [e.token_id for e in events]
    ref = reference_logprobs(reference, prompt + tokens)
    for j, token in enumerate(tokens):
        counts = torch.bincount(torch.tensor(tokens[:j], dtype=torch.int64), minlength=ref.shape[1]).double()
        adjusted = ref[len(prompt) - 1 + j] - 1.5 * counts - 0.5 * (counts > 0).double()
        assert adjusted.argmax().item() == token


@pytest.mark.parametrize("params, message", [
    (SamplingParams(logprobs=True, top_logprobs=21), "top_logprobs 21 is outside 0..20"),
    (SamplingParams(prompt_logprobs=-1), "prompt_logprobs -1 is outside 0..20"),
    (SamplingParams(logit_bias=((49152, 1.0),)), "logit_bias token id 49152 is outside the vocabulary"),
])
def test_the_engine_refuses_what_it_cannot_report(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request([5, 6, 7], params)
    pool_is_whole(engine)
