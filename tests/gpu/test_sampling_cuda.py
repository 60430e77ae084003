"""Log-probabilities, n and the logit adjustments on the GPU in bfloat16."""

import asyncio
import random

import pytest
import torch

from models import load_model
from server.engine import Engine, EngineConfig, FinishEvent, SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.model_runner import ModelRunner
from server.engine.penalties import PenaltyState
from server.engine.sampler import SamplingRows, sample_clean
from server.engine.sequence import Sequence

from ..helpers import decode_continuation, perturb_small_tensors

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# The engine's logits are the bf16 model's, read as float32; the log-softmax is taken in float32.
# Against float64 of the same logits that is ~1e-6; the bound covers a teacher-forced run that
# replays another graph bucket than the engine's step did (bf16 rounding of a different schedule).
BF16_LOGPROB_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def loaded():
    model = load_model("random:smollm2-135m", dtype="bfloat16", device="cuda")
    perturb_small_tensors(model.model, seed=5)
    return model


@pytest.fixture(scope="module")
def engine(loaded):
    engine = Engine(loaded, EngineConfig(max_batch=16, num_blocks=256, block_size=32, graph_buckets=(1, 2, 4, 8, 16)))
    engine.start()
    yield engine
    engine.shutdown()


def prompt_of(length, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(length)]


def run(engine, requests):
    """[(prompt, params, follows index or None)] -> [(token events, finish)]"""
    async def main():
        streams = []
        for prompt, params, follows in requests:
            extra = {"follows": streams[follows].request_id} if follows is not None else {}
            streams.append(engine.add_request(prompt, params, **extra))

        async def events(stream):
            out = []
            async for event in stream:
                if isinstance(event, FinishEvent):
                    return out, event
                out.append(event)
        return await asyncio.gather(*(events(s) for s in streams))
    return asyncio.run(main())


@torch.inference_mode()
def teacher_forced(loaded, prompt, continuation):
    runner = ModelRunner(loaded, EngineConfig(max_batch=4, num_blocks=64, block_size=32, graph_buckets=(1, 4)),
                         max_model_len=1024)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seq = Sequence("tf", prompt, SamplingParams(), seed=0)
    blocks.grow(seq.block_table, seq.length)
    return decode_continuation(runner, blocks, seq, runner.prefill([(seq, seq.length)])[0], continuation)


def test_bf16_logprobs_are_the_log_softmax_of_the_steps_logits(engine, loaded):
    prompt = prompt_of(50, 1)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True, logprobs=True,
                            top_logprobs=20, frequency_penalty=0.4, logit_bias=((7, 1.5),))
    [(events, _)] = run(engine, [(prompt, params, None)])
    logits = teacher_forced(loaded, prompt, [e.token_id for e in events])
    reference = logits.double().log_softmax(-1)
    for row, event in zip(reference, events):
        assert abs(event.logprob - row[event.token_id].item()) < BF16_LOGPROB_TOLERANCE
        values = [v for _, v in event.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert max(abs(v - b) for v, b in zip(values, row.topk(20).values.tolist())) < BF16_LOGPROB_TOLERANCE


def test_bf16_prompt_logprobs_match_a_teacher_forced_forward(engine, loaded):
    prompt = prompt_of(300, 2)
    [(events, _)] = run(engine, [(prompt, SamplingParams(max_new_tokens=1, prompt_logprobs=2), None)])
    runner = ModelRunner(loaded, EngineConfig(max_batch=4, num_blocks=64, block_size=32, graph_buckets=(1,)),
                         max_model_len=1024)
    seq = Sequence("pl", prompt, SamplingParams(), seed=0)
    BlockManager(runner.num_blocks, runner.block_size).grow(seq.block_table, seq.length)
    with torch.inference_mode():
        _, (every,) = runner._prefill_packed([(seq, seq.length)], every_row_of=[0])
    reference = every.double().log_softmax(-1)
    got = events[0].prompt_logprobs
    assert len(got) == len(prompt) - 1
    for i, (value, _, _) in enumerate(got):
        assert abs(value - reference[i, prompt[i + 1]].item()) < BF16_LOGPROB_TOLERANCE


def test_bf16_n_greedy_choices_match_one_choice(engine):
    prompt = prompt_of(1024, 3)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    results = run(engine, [(prompt, params, None)] + [(prompt, params, 0)] * 7)
    first = [e.token_id for e in results[0][0]]
    assert all([e.token_id for e in events] == first for events, _ in results)
    assert all(events[0].cached_tokens == 1024 for events, _ in results[1:])    # 32 full blocks of 32, shared
    assert len({events[0].time for events, _ in results}) == 1                 # first tokens from one prefill
    assert engine.core.blocks.num_used == 0


def test_penalties_and_logprobs_on_the_device_never_wait_for_the_host():
    vocab, n = 49152, 64
    state = PenaltyState(vocab, torch.device("cuda"))
    penalty_rows = [state.acquire(0.5, 0.2, ((3, 1.0),)) if i % 2 else -1 for i in range(n)]
    logits = torch.randn(n, vocab, device="cuda")
    rows = SamplingRows(temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, repetition_penalty=[1.0] * n,
                        seeds=list(range(n)), positions=[0] * n, history=None,
                        logprobs=[20 if i % 3 else -1 for i in range(n)], penalty_rows=penalty_rows)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ids, logprobs = sample_clean(logits.clone(), rows, penalties=state)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logprobs.top_ids.shape == (len(logprobs.rows), 20)
    assert state.counts[penalty_rows[1]].sum().item() == 3
