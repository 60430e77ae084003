"""Engine pieces on the CPU: pool accounting, scheduling under pressure, sampling, text."""

import asyncio
import random

import pytest
import torch

from models import load_model
from server.engine import Engine, EngineConfig, FinishEvent, SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from server.engine.sampler import SamplingRows, argmax_rows, hashed_uniforms, sample

from .helpers import (check_one_request_fails_then_the_engine_serves, failing_on_second_call, run_all,
                      tokens_under)


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny", dtype="float32", device="cpu")


def test_block_manager_grows_and_releases():
    blocks = BlockManager(num_blocks=10, block_size=4)
    table: list[int] = []
    blocks.grow(table, 9)
    assert len(table) == 3 and blocks.num_free == 7
    blocks.grow(table, 12)
    assert len(table) == 3
    assert not blocks.can_grow(table, 4 * 11)
    with pytest.raises(RuntimeError):
        blocks.grow(table, 4 * 11)
    blocks.release(table)
    assert table == [] and blocks.num_free == 10


def test_every_block_returns_after_aborts_and_preemption(tiny):
    # A pool far smaller than the offered load forces preemption; some requests are aborted.
    engine = Engine(tiny, EngineConfig(max_batch=16, num_blocks=24, block_size=16, max_prefill_tokens=96))
    engine.start()
    rng = random.Random(1234)
    requests = []
    for i in range(200):
        prompt = [rng.randrange(3, 49000) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=True,
                                temperature=rng.choice([0.0, 0.7]), seed=i)
        requests.append((prompt, params, rng.randint(1, 5) if i % 7 == 0 else None))
    try:
        results = run_all(engine, requests)
        reasons = [finish.reason for _, _, finish in results]
        assert reasons.count("abort") >= 1 and "error" not in reasons
        for (prompt, params, abort_after), (tokens, _, finish) in zip(requests, results):
            assert finish.completion_tokens == len(tokens)
            if finish.reason == "length":
                assert len(tokens) == params.max_new_tokens
        assert engine.stats().preemptions > 0
        assert engine.core.blocks.num_free == engine.core.blocks.num_blocks
        assert engine.stats().running == engine.stats().waiting == 0
    finally:
        engine.shutdown()


def test_preempted_request_gives_the_same_tokens(tiny):
    prompts = [[5 + i + j for j in range(40)] for i in range(6)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    roomy = Engine(tiny, EngineConfig(max_batch=8, num_blocks=64, block_size=16))
    tight = Engine(tiny, EngineConfig(max_batch=8, num_blocks=12, block_size=16))
    for e in (roomy, tight):
        e.start()
    try:
        expected = run_all(roomy, [(p, params) for p in prompts])
        got = run_all(tight, [(p, params) for p in prompts])
        assert tight.stats().preemptions > 0
        assert [t for t, _, _ in got] == [t for t, _, _ in expected]
    finally:
        roomy.shutdown()
        tight.shutdown()


def test_long_prompt_is_prefilled_in_chunks(tiny):
    engine = Engine(tiny, EngineConfig(max_batch=4, num_blocks=64, block_size=16, max_prefill_tokens=32))
    whole = Engine(tiny, EngineConfig(max_batch=4, num_blocks=64, block_size=16, max_prefill_tokens=4096))
    prompt = [7 + (i * 31) % 4000 for i in range(150)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for e in (engine, whole):
        e.start()
    try:
        (chunked,) = run_all(engine, [(prompt, params)])
        (single,) = run_all(whole, [(prompt, params)])
        assert chunked[0] == single[0]
        assert engine.core.steps >= 150 // 32 + 8
    finally:
        engine.shutdown()
        whole.shutdown()


def test_a_preempted_request_waits_behind_a_prompt_being_prefilled_in_chunks(tiny):
    """Two streams fill a pool of one context while a long prompt is prefilled in chunks between
    their steps; when both are preempted, neither may stand in front of the prompt that holds
    blocks, or nothing could run again."""
    from server.engine import EngineCore

    finished = []
    core = EngineCore(tiny, EngineConfig(block_size=16, num_blocks=8, max_model_len=128, max_prefill_tokens=32),
                      publish=lambda pairs, stats: finished.extend(r for r, e in pairs if isinstance(e, FinishEvent)))
    core.add("a", list(range(10, 20)), SamplingParams(max_new_tokens=100, ignore_eos=True), 1)
    core.add("b", list(range(30, 40)), SamplingParams(max_new_tokens=100, ignore_eos=True), 2)
    core.add("long", list(range(100, 200)), SamplingParams(max_new_tokens=10, ignore_eos=True), 3)
    for _ in range(1000):
        if not core.busy():
            break
        core._publish(core.step())
    assert sorted(finished) == ["a", "b", "long"] and core.scheduler.preemptions > 0
    assert core.blocks.num_used == 0


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_a_prompt_id_outside_the_vocabulary_is_refused_and_the_engine_keeps_serving(tiny, bad):
    engine = Engine(tiny, EngineConfig(max_batch=4, num_blocks=32, block_size=16))
    engine.start()
    try:
        vocab = tiny.model.get_input_embeddings().num_embeddings
        bad = vocab if bad == "vocab" else bad
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)

        async def refused():
            with pytest.raises(ValueError, match=f"token id {bad} is outside the model's vocabulary of {vocab}"):
                engine.add_request([10, bad, 11], params)
        asyncio.run(refused())
        ((tokens, _, finish),) = run_all(engine, [([10, vocab - 1, 11], params)])
        assert finish.reason == "length" and len(tokens) == 3
    finally:
        engine.shutdown()


def test_a_pool_smaller_than_the_context_serves_and_advertises_the_pools_length(tiny, caplog):
    from server.engine import EngineCore

    with caplog.at_level("WARNING", logger="server.engine.core"):
        core = EngineCore(tiny, EngineConfig(max_batch=2, num_blocks=4, block_size=16), publish=lambda p, s: None)
    assert tiny.max_model_len > 64 and core.info.max_model_len == core.scheduler.max_model_len == 64
    assert f"fewer than the context length of {tiny.max_model_len}" in caplog.text
    roomy = EngineCore(tiny, EngineConfig(max_batch=2, num_blocks=4, block_size=16, max_model_len=48),
                       publish=lambda p, s: None)
    assert roomy.info.max_model_len == 48


def rows(n, **kw):
    base = dict(temperature=[1.0] * n, top_k=[0] * n, top_p=[1.0] * n, repetition_penalty=[1.0] * n,
                seeds=list(range(n)), positions=[0] * n, history=None)
    base.update(kw)
    return SamplingRows(**base)


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(5, 300)
    best = logits.argmax(-1)
    assert torch.equal(sample(logits, rows(5, temperature=[0.0] * 5))[0], best)
    assert torch.equal(sample(logits, rows(5, top_k=[1] * 5))[0], best)
    assert torch.equal(sample(logits, rows(5, top_p=[1e-6] * 5))[0], best)


def tied_logits(rows: int, width: int, device="cpu") -> torch.Tensor:
    """Logits with many ties (a few distinct values), some rows all equal, some with -inf."""
    x = torch.randint(0, 4, (rows, width), device=device).float()
    x[0] = 1.0
    if rows > 2:
        x[2, : width // 2] = float("-inf")
    return x


@pytest.mark.parametrize("width", [49152, 128256, 151936, 262144, 1000, 997])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_two_pass_argmax_is_the_first_maximum(rows, width):
    x = tied_logits(rows, width)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    y = torch.randn(rows, width)
    assert torch.equal(argmax_rows(y), y.argmax(dim=-1))


def test_seeded_draw_does_not_depend_on_the_batch():
    logits = torch.randn(4, 1000)
    alone = sample(logits[2:3], rows(1, seeds=[99], positions=[7]))[0]
    batched = sample(logits, rows(4, seeds=[1, 2, 99, 4], positions=[0, 3, 7, 1]))[0]
    assert batched[2] == alone[0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().expand(n, 4).clone()
    ids = sample(logits, rows(n, seeds=list(range(n))))[0]
    freq = torch.bincount(ids, minlength=4).double() / n
    assert (freq - probs.double()).abs().max() < 0.03


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(500, 5).clone()
    k2 = sample(logits, rows(500, top_k=[2] * 500, seeds=list(range(500))))[0]
    assert set(k2.tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)
    top_p = float(p[0] + p[1] / 2)                # the first two tokens are needed to reach it
    pp = sample(logits, rows(500, top_p=[top_p] * 500, seeds=list(range(500))))[0]
    assert set(pp.tolist()) == {0, 1}


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    r = rows(1, temperature=[0.0], repetition_penalty=[2.0], history=[[0]])
    assert sample(logits.clone(), r)[0].item() == 1


def test_logprobs_are_log_softmax_of_the_chosen_token():
    logits = torch.randn(3, 50)
    ids, logprobs = sample(logits, rows(3, temperature=[0.0] * 3, logprobs=[0] * 3))
    assert torch.allclose(logprobs.sampled, logits.log_softmax(-1).gather(1, ids[:, None]).squeeze(1))


def test_hashed_uniforms_are_uniform_and_in_range():
    u = hashed_uniforms(torch.tensor([1, 2**40 + 5]), torch.tensor([0, 9]), 50000)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


def test_detokenizer_never_emits_broken_characters(tiny):
    tokenizer = tiny.tokenizer
    text = "Grüße aus Köln 🚀🔥 — 東京タワー ok"
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[1])
    pieces = [detok.step(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_matcher_holds_back_a_possible_prefix():
    m = StopMatcher(("STOP",))
    release, stopped = m.scan("abc ST", emitted=0, added=6)
    assert not stopped and release == 3
    release, stopped = m.scan("abc STOP more", emitted=3, added=7)
    assert stopped and release == 4


def test_repetition_penalty_and_every_option_through_the_engine(tiny):
    engine = Engine(tiny, EngineConfig(max_batch=4, num_blocks=32, block_size=16))
    engine.start()
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=10**6, top_p=0.9,
                                repetition_penalty=1.3, seed=5, logprobs=True, ignore_eos=True)
        (tokens, _, finish), = run_all(engine, [([5, 6, 7, 8], params)])
        assert finish.reason == "length" and len(tokens) == 12
        assert engine.error is None
    finally:
        engine.shutdown()


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(tiny):
    engine = Engine(tiny, EngineConfig(max_batch=4, num_blocks=32, block_size=16))
    engine.core.runner._decode = failing_on_second_call(engine.core.runner._decode)
    engine.start()
    try:
        check_one_request_fails_then_the_engine_serves(engine)
        assert engine.error is None and engine.core.blocks.num_free == engine.core.blocks.num_blocks
    finally:
        engine.shutdown()


def test_padded_single_prompt_prefill_matches_the_packed_one(tiny):
    """The path CUDA graphs replay on the GPU, run eagerly: same logits and same cache."""
    from server.engine.model_runner import ModelRunner
    from server.engine.sequence import Sequence

    def run(buckets, lengths):
        runner = ModelRunner(tiny, EngineConfig(max_batch=4, num_blocks=32, block_size=16,
                                                prefill_graph_buckets=buckets), max_model_len=512)
        blocks = BlockManager(runner.num_blocks, runner.block_size)
        chunks = []
        for n in lengths:
            seq = Sequence(f"s{n}", [7 + (i * 13) % 3000 for i in range(n)], SamplingParams(), 0)
            blocks.grow(seq.block_table, n)
            chunks.append((seq, n))
        with torch.inference_mode():
            return runner.prefill(chunks), runner.kv_caches[1][0].clone()

    lengths = [5, 16, 40]
    padded, padded_cache = run((16, 64), lengths)
    packed, packed_cache = run((), lengths)
    assert torch.allclose(padded, packed, atol=1e-5, rtol=1e-5)
    assert torch.allclose(padded_cache, packed_cache, atol=1e-6)


def test_engine_with_prefill_buckets_gives_the_same_tokens(tiny):
    prompts = [[9 + (i * 7 + j) % 4000 for j in range(n)] for i, n in enumerate([3, 30, 64])]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    configs = [EngineConfig(max_batch=4, num_blocks=64, block_size=16, prefill_graph_buckets=buckets)
               for buckets in ((16, 64), ())]
    results = tokens_under(tiny, configs, [(p, params) for p in prompts])
    assert results[0] == results[1]


def test_arrivals_wait_to_be_prefilled_together_while_others_decode():
    from server.engine.scheduler import DecodeStep, PrefillStep, Scheduler
    from server.engine.sequence import Sequence

    def seq(name):
        return Sequence(name, list(range(10, 30)), SamplingParams(max_new_tokens=100), seed=0)

    def prefill(step):
        for s, take in step.chunks:
            s.num_cached += take
            sched.prefill_done(s)

    sched = Scheduler(BlockManager(64, 16), max_batch=8, max_prefill_tokens=4096, max_model_len=512,
                      prefill_delay_steps=3)
    sched.add(seq("first"))
    step = sched.schedule()
    assert isinstance(step, PrefillStep)                  # nothing decodes: no waiting
    prefill(step)
    sched.add(seq("a"))
    kinds = []
    for i in range(4):
        if i == 1:
            sched.add(seq("b"))
        step = sched.schedule()
        kinds.append(type(step).__name__)
        if isinstance(step, PrefillStep):
            assert [s.request_id for s, _ in step.chunks] == ["a", "b"]
            prefill(step)
    assert kinds == ["DecodeStep", "DecodeStep", "DecodeStep", "PrefillStep"]
    # arrivals that fill every free row do not wait (but a prefill never follows a prefill)
    for name in "cdefgh":
        sched.add(seq(name))
    assert isinstance(sched.schedule(), DecodeStep)
    assert isinstance(sched.schedule(), PrefillStep)


@pytest.mark.parametrize("delay", [0, 2])
def test_a_short_prefill_follows_a_prefill_at_once_but_never_a_third(delay):
    from server.engine.scheduler import DecodeStep, PrefillStep, Scheduler
    from server.engine.sequence import Sequence

    blocks = BlockManager(64, 16, prefix_caching=True)
    sched = Scheduler(blocks, max_batch=8, max_prefill_tokens=4096, max_model_len=512,
                      prefill_delay_steps=delay, chained_prefill_tokens=40)

    def prefill(step):
        assert isinstance(step, PrefillStep)
        for s, take in step.chunks:
            s.num_cached += take
            blocks.commit(s)
            sched.prefill_done(s)

    long_start = list(range(100, 196))                              # six blocks
    sched.add(Sequence("first", long_start + [7], SamplingParams(max_new_tokens=100), seed=0))
    prefill(sched.schedule())
    assert isinstance(sched.schedule(), DecodeStep)
    for name in "ab":
        sched.add(Sequence(name, list(range(10, 40)), SamplingParams(max_new_tokens=5), seed=0))
    if delay:
        for _ in range(delay - 1):
            assert isinstance(sched.schedule(), DecodeStep)
    prefill(sched.schedule())                                     # a and b: 60 tokens
    # 97 tokens, of which the cache holds 96: one to compute, so it follows at once (without a delay)
    sched.add(Sequence("c", long_start + [8], SamplingParams(max_new_tokens=5), seed=0))
    step = sched.schedule()
    if delay:
        assert isinstance(step, DecodeStep)
        return
    assert [(s.request_id, s.num_cached, take) for s, take in step.chunks] == [("c", 96, 1)]
    prefill(step)
    sched.add(Sequence("d", [5, 6, 7], SamplingParams(max_new_tokens=5), seed=0))
    assert isinstance(sched.schedule(), DecodeStep)                # never three in a row
    prefill(sched.schedule())
    sched.add(Sequence("e", list(range(300, 341)), SamplingParams(max_new_tokens=5), seed=0))
    assert isinstance(sched.schedule(), DecodeStep)                # 41 tokens: over the 40 that chain
    prefill(sched.schedule())
    sched.add(Sequence("f", list(range(400, 440)), SamplingParams(max_new_tokens=5), seed=0))
    prefill(sched.schedule())                                     # 40 tokens: as many as chain


def test_a_long_prompt_alternates_with_decodes_but_for_a_short_last_chunk():
    from server.engine.scheduler import DecodeStep, PrefillStep, Scheduler
    from server.engine.sequence import Sequence

    blocks = BlockManager(64, 16)
    sched = Scheduler(blocks, max_batch=8, max_prefill_tokens=48, max_model_len=512, chained_prefill_tokens=40)
    first = Sequence("first", list(range(10, 30)), SamplingParams(max_new_tokens=100), seed=0)
    sched.add(first)
    sched.schedule()
    first.num_cached = first.length
    sched.prefill_done(first)
    assert isinstance(sched.schedule(), DecodeStep)
    long = Sequence("long", list(range(100, 240)), SamplingParams(max_new_tokens=5), seed=0)   # 140 tokens
    sched.add(long)
    kinds = []
    while long.status.value == "waiting":
        step = sched.schedule()
        kinds.append((type(step).__name__, [take for _, take in step.chunks] if isinstance(step, PrefillStep) else None))
        if isinstance(step, PrefillStep):
            for s, take in step.chunks:
                s.num_cached += take
                if s.prefill_remaining == 0:
                    sched.prefill_done(s)
    # 48, 48 (92 left: over 40, a decode between), then 44: over 40 too; a chunk of at most 40 would chain
    assert kinds == [("PrefillStep", [48]), ("DecodeStep", None), ("PrefillStep", [48]), ("DecodeStep", None),
                     ("PrefillStep", [44])]
    sched.add(Sequence("next", list(range(300, 400)), SamplingParams(max_new_tokens=5), seed=0))   # 100 tokens
    assert isinstance(sched.schedule(), DecodeStep)
    step = sched.schedule()
    assert [take for _, take in step.chunks] == [48]
    step.chunks[0][0].num_cached += 48
    step = sched.schedule()                                        # 52 left: a decode between
    assert isinstance(step, DecodeStep)
    step = sched.schedule()
    assert [take for _, take in step.chunks] == [48]
    step.chunks[0][0].num_cached += 48
    step = sched.schedule()                                        # its last 4 tokens follow at once
    assert isinstance(step, PrefillStep) and [take for _, take in step.chunks] == [4]


def test_by_default_an_arrival_is_prefilled_at_the_next_step():
    from server.engine.scheduler import DecodeStep, PrefillStep, Scheduler
    from server.engine.sequence import Sequence

    sched = Scheduler(BlockManager(64, 16), max_batch=8, max_prefill_tokens=4096, max_model_len=512)
    first = Sequence("first", list(range(10, 30)), SamplingParams(max_new_tokens=100), seed=0)
    sched.add(first)
    step = sched.schedule()
    first.num_cached = first.length
    sched.prefill_done(first)
    assert isinstance(sched.schedule(), DecodeStep)
    sched.add(Sequence("next", list(range(10, 20)), SamplingParams(max_new_tokens=5), seed=0))
    step = sched.schedule()
    assert isinstance(step, PrefillStep) and [s.request_id for s, _ in step.chunks] == ["next"]


def test_a_prefill_is_launched_while_the_decode_step_is_in_flight(tiny):
    from server.engine import EngineCore

    core = EngineCore(tiny, EngineConfig(max_batch=4, num_blocks=32, block_size=16), publish=lambda *a: None)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    core.add("first", list(range(10, 30)), params, seed=0)
    while core.scheduler.waiting or not core.runner.pipeline.busy:
        core.step()
    launched_behind = []
    prefill_step = core.runner.prefill_step

    def recording(*args, **kwargs):
        launched_behind.append(core.runner.pipeline.busy)
        return prefill_step(*args, **kwargs)

    core.runner.prefill_step = recording
    core.add("second", list(range(40, 50)), params, seed=0)
    events = core.step()
    assert launched_behind == [True]
    # the step gives the new request its first token and the running one the token that was in flight
    assert sorted({request_id for request_id, _ in events}) == ["first", "second"]
    assert not core.runner.pipeline.busy
    core.run_until_idle()
    assert core.blocks.num_used == 0


def test_warm_up_fits_a_small_pool_and_leaves_it_empty(tiny):
    from server.engine import EngineCore

    core = EngineCore(tiny, EngineConfig(max_batch=4, num_blocks=3, block_size=16), publish=lambda p, s: None)
    core._warm_up()                        # runs on GPUs only at start-up; here it must just finish
    assert not core.busy() and core.blocks.num_free == core.blocks.num_blocks


def test_the_throughput_log_line_splits_decode_and_prefill_time():
    from server.engine.core import StepStats
    stats = StepStats()
    stats.decode_steps, stats.prefill_steps, stats.generated, stats.prompt_tokens = 100, 4, 6400, 512
    stats.add_time((99, 4), 0.12)
    stats.add_time((100, 3), 0.02)
    stats.add_time((100, 4), 5.0)                    # read back only: neither kind
    stats.device_wait_s = 0.0104
    line = stats.line(stats.since + 2.0, running=64, waiting=2, kv_used=0.5)
    assert line == ("prompt 256 tok/s, generation 3200 tok/s; 50 decode steps/s at 1.20 ms + 2.0 prefill steps/s "
                    "at 5.00 ms, waiting for the device 0.10 ms per step; running 64, waiting 2, KV cache 50.0% used")


def test_decode_metadata_rows_and_padding(tiny):
    from server.engine.model_runner import ModelRunner
    from server.engine.sequence import Sequence
    runner = ModelRunner(tiny, EngineConfig(max_batch=8, num_blocks=64, block_size=4), max_model_len=64)
    rng = random.Random(7)
    runner.pipeline.sampled[:] = torch.arange(100, 108, dtype=torch.int32)
    seqs, sources = [], []
    for i in range(5):
        seq = Sequence(f"s{i}", [rng.randrange(3, 900) for _ in range(rng.randint(1, 20))], SamplingParams(), 0)
        for _ in range(rng.randint(0, 6)):
            seq.append(rng.randrange(3, 900))
        seq.pending = rng.randint(0, 1)
        seq.block_table = rng.sample(range(64), -(-seq.total_len // 4))
        seqs.append(seq)
        sources.append(rng.choice([-1, i + 2]))
    full = [Sequence(f"f{i}", list(range(3, 40)), SamplingParams(), 0) for i in range(8)]
    for seq in full:
        seq.block_table = list(range(50, 60))
    for _ in range(2):                                 # both host buffers hold stale rows now
        runner.pipeline.load(full, [-1] * 8, 8)
    rows = 8                                           # a bucket larger than the batch: 3 padding rows
    runner.pipeline.load(seqs, sources, rows)
    runner.pipeline.select_inputs(rows)
    width = max(len(s.block_table) for s in seqs)
    for i in range(rows):
        if i < len(seqs):
            s, p = seqs[i], seqs[i].total_len - 1
            token = 100 + sources[i] if sources[i] >= 0 else (s.output_ids or s.prompt_ids)[-1]
            table = s.block_table + [0] * (width - len(s.block_table))
            expected = (token, p, s.block_table[p // 4] * 4 + p % 4, p + 1, table)
        else:
            expected = (0, 0, -1, 1, [0] * width)     # padding: writes nothing, attends to one slot
        got = (runner.input_ids[i, 0].item(), runner.positions[i, 0].item(), runner.slots[i].item(),
               runner.seq_lens[i].item(), runner.block_tables[i, :width].tolist())
        assert got == expected, (i, got, expected)


def test_a_request_sent_as_the_core_thread_dies_still_gets_an_error(tiny):
    import asyncio
    import threading
    engine = Engine(tiny, EngineConfig(max_batch=4, num_blocks=32, block_size=16))

    def broken_step():
        raise RuntimeError("device broke")

    engine.core.step = broken_step
    real_fail_all = engine.core.fail_all
    failures = []

    async def main():
        loop = asyncio.get_running_loop()
        late = {}

        def fail_all(message):                 # the third failure in a row ends the core
            failures.append(message)
            if len(failures) == 3:              # a request lands after the core's last look at its inbox
                added = threading.Event()

                def add():
                    late["stream"] = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3))
                    added.set()
                loop.call_soon_threadsafe(add)
                added.wait(5)
            real_fail_all(message)

        engine.core.fail_all = fail_all
        engine.start()
        for _ in range(3):
            events = [e async for e in engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3))]
            assert events[-1].reason == "error"
        last = await asyncio.wait_for(late["stream"].__anext__(), 5)
        return last, engine._queued_requests

    last, queued = asyncio.run(main())
    assert isinstance(last, FinishEvent) and last.reason == "error" and queued == 0
    assert engine.error is not None
