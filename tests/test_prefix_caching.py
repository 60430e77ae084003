"""Prefix caching on the CPU in fp32, greedy: every output with caching on equals the output
with it off, token for token, and the pool stays consistent (``BlockManager.check``)."""

import hashlib
import random

import pytest
import torch

from models import load_model
from server.engine import EngineConfig, EngineCore, FinishEvent, SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.sequence import Sequence

BS = 16


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny", dtype="float32", device="cpu")


def make_core(tiny, caching: bool, num_blocks: int = 64, max_batch: int = 8, max_prefill_tokens: int = 4096):
    return EngineCore(tiny, EngineConfig(max_batch=max_batch, num_blocks=num_blocks, block_size=BS,
                                         max_prefill_tokens=max_prefill_tokens, prefix_caching=caching),
                      publish=lambda pairs, stats: None)


def drive(core, requests, check_every_step: bool = False):
    """Runs ``requests`` [(prompt, max_new, arrival_step, abort_after)] through ``core`` step by
    step; returns {index: (tokens, finish)} and checks the pool after every step if asked."""
    tokens = {i: [] for i in range(len(requests))}
    finishes = {}
    seqs = {}
    order = sorted(range(len(requests)), key=lambda i: requests[i][2])
    step, nxt = 0, 0

    def take(events):
        for rid, event in events:
            i = int(rid[1:])
            if isinstance(event, FinishEvent):
                finishes[i] = event
            else:
                tokens[i].append(event.token_id)
                abort_after = requests[i][3]
                if abort_after is not None and len(tokens[i]) == abort_after and i not in finishes:
                    core.abort(rid)

    core.publish = lambda pairs, stats: take(pairs)
    while nxt < len(order) or core.busy():
        while nxt < len(order) and requests[order[nxt]][2] <= step:
            i = order[nxt]
            prompt, max_new, _, _ = requests[i]
            core.add(f"r{i}", prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True), seed=i)
            seqs[i] = core.scheduler.waiting[-1]
            nxt += 1
        take(core.step())
        step += 1
        if check_every_step:
            check_pool(core, seqs.values())
    check_pool(core, seqs.values())
    return {i: (tokens[i], finishes[i]) for i in range(len(requests))}


def check_pool(core, seqs):
    held = list(core.scheduler.running) + list(core.scheduler.waiting)
    finished = [s.block_table for s in seqs if s.is_finished]
    core.blocks.check([s.block_table for s in held], finished)


def on_and_off(tiny, requests, **kwargs):
    results = []
    for caching in (True, False):
        core = make_core(tiny, caching, **kwargs)
        results.append((drive(core, requests, check_every_step=caching), core))
    (on, core_on), (off, _) = results
    for i in range(len(requests)):
        assert on[i][0] == off[i][0], f"request {i}: {on[i][0]} with caching, {off[i][0]} without"
    return on, off, core_on


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49000) for _ in range(n)]


# ---- the block manager alone --------------------------------------------------------------

def seq_of(tokens, name="s", cache_salt=None) -> Sequence:
    return Sequence(name, tokens, SamplingParams(cache_salt=cache_salt), 0)


def computed(blocks: BlockManager, seq: Sequence) -> None:
    """As the engine does after a prefill: the whole prompt computed and its full blocks keyed."""
    seq.num_cached = blocks.match(seq)
    blocks.grow(seq.block_table, seq.length)
    seq.num_cached = seq.length
    blocks.commit(seq)


def test_keys_chain_through_the_parent_and_are_salted():
    a, b = BlockManager(8, 4, True, salt="model-a"), BlockManager(8, 4, True, salt="model-b")
    s1, s2, s3 = seq_of([1, 2, 3, 4, 5, 6, 7, 8]), seq_of([1, 2, 3, 4, 5, 6, 7, 8]), seq_of([9, 2, 3, 4, 5, 6, 7, 8])
    k1, k2, k3 = a._keys(s1, 2), b._keys(s2, 2), a._keys(s3, 2)
    assert len(k1[0]) == 32 and k1[0] != k2[0]                 # SHA-256, salted by the model
    assert k1[1] != k3[1]                                      # same tokens, other parent: other key
    assert BlockManager(8, 8, True, salt="model-a")._root != a._root      # salted by the block size


def test_keys_are_sha256_of_the_parent_and_the_tokens_as_int64_across_prompt_and_output():
    rng = random.Random()
    blocks = BlockManager(8, 16, True, salt="m")
    for _ in range(20):
        seq = seq_of([rng.randrange(0, 1 << 40) for _ in range(rng.randint(1, 100))])
        for _ in range(rng.randint(0, 40)):
            seq.append(rng.randrange(0, 1 << 17))
        n = seq.length // 16
        parent, expected = blocks._root, []
        for i in range(n):
            data = b"".join(t.to_bytes(8, "little") for t in seq.token_ids[16 * i:16 * (i + 1)])
            parent = hashlib.sha256(parent + data).digest()
            expected.append(parent)
        assert blocks._keys(seq, n // 2) == expected[:n // 2]      # computed in two goes, as the engine does
        assert blocks._keys(seq, n) == expected


def test_a_cache_salt_starts_the_chain_from_the_root_hashed_with_it():
    blocks = BlockManager(8, 2, True, salt="m")
    salted = hashlib.sha256(blocks._root + b"cache_salt|" + "tenant é".encode()).digest()
    data = (5).to_bytes(8, "little") + (6).to_bytes(8, "little")
    assert blocks._keys(seq_of([5, 6, 7], cache_salt="tenant é"), 1) == [hashlib.sha256(salted + data).digest()]
    assert blocks._keys(seq_of([5, 6, 7]), 1) == [hashlib.sha256(blocks._root + data).digest()]


def test_blocks_are_shared_only_among_requests_with_the_same_salt():
    blocks = BlockManager(32, 4, True)
    tokens = list(range(10, 23))                               # three full blocks and one token
    held = []
    for salt in (None, "a"):
        s = seq_of(tokens, cache_salt=salt)
        computed(blocks, s)
        held.append(s)
    found = {salt: blocks.cached_prefix(seq_of(tokens, cache_salt=salt)) for salt in (None, "a", "b", "A")}
    assert found == {None: 12, "a": 12, "b": 0, "A": 0}
    assert not set(held[0].block_table) & set(held[1].block_table)
    blocks.check([s.block_table for s in held])


def test_match_shares_full_blocks_only_and_never_the_last_token():
    blocks = BlockManager(16, 4, True)
    first = seq_of(list(range(10, 20)))                        # 10 tokens: two full blocks and a partial one
    computed(blocks, first)
    again = seq_of(list(range(10, 20)))
    assert blocks.match(again) == 8                            # the partial block is not shared
    assert again.block_table == first.block_table[:2]
    exact = seq_of(list(range(10, 18)))                        # 8 tokens: its last token must be computed
    assert blocks.match(exact) == 4 and exact.block_table == first.block_table[:1]
    assert blocks._refs[first.block_table[0]] == 3
    blocks.check([first.block_table, again.block_table, exact.block_table])
    for s in (first, again, exact):
        blocks.free(s)
    blocks.check([])
    assert blocks.num_free == 16 and blocks.num_cached_idle == 2


def test_eviction_takes_empty_blocks_first_then_the_oldest_deepest_cached_block():
    blocks = BlockManager(6, 4, True)
    old, new = seq_of(list(range(100, 113))), seq_of(list(range(200, 213)))   # 3 full blocks + 1 token each
    computed(blocks, old)
    blocks.free(old)                                           # 3 cached blocks, its partial one empty
    assert blocks.num_cached_idle == 3 and len(blocks._empty) == 3
    computed(blocks, new)                                      # 4 blocks: the 3 empty ones, then one evicted
    assert blocks.num_cached_idle == 2
    again = seq_of(list(range(100, 113)))
    assert blocks.match(again) == 8                            # old's deepest block went, its first two stay
    blocks.check([new.block_table, again.block_table])


def test_a_block_whose_key_exists_stays_unkeyed_and_is_freed_plainly():
    blocks = BlockManager(8, 4, True)
    a, b = seq_of(list(range(1, 10)), "a"), seq_of(list(range(1, 10)), "b")
    for s in (a, b):                                           # both computed in one step: no hit for b
        s.num_cached = blocks.match(s)
    for s in (a, b):
        blocks.grow(s.block_table, s.length)
        s.num_cached = s.length
        blocks.commit(s)
    assert not set(a.block_table) & set(b.block_table)
    blocks.free(a)
    blocks.free(b)
    blocks.check([])
    assert blocks.num_cached_idle == 2 and len(blocks._empty) == 6


def test_off_nothing_is_shared_and_the_counters_still_count():
    blocks = BlockManager(8, 4, False)
    a = seq_of(list(range(1, 10)))
    computed(blocks, a)
    blocks.free(a)
    b = seq_of(list(range(1, 10)))
    assert blocks.match(b) == 0 and blocks.num_cached_idle == 0
    assert blocks.query_tokens == 18 and blocks.hit_tokens == 0


def test_the_checker_finds_what_it_is_for():
    blocks = BlockManager(8, 4, True)
    a = seq_of(list(range(1, 10)))
    computed(blocks, a)
    with pytest.raises(AssertionError, match="finished"):
        blocks.check([], [a.block_table])                      # a finished request still holding blocks
    with pytest.raises(AssertionError, match="sequences hold it"):
        blocks.check([])                                       # blocks held by nobody the engine knows
    blocks.release(list(a.block_table))                        # freed, yet still in a's table
    with pytest.raises(AssertionError):
        blocks.check([a.block_table])


# ---- the engine, caching on against off --------------------------------------------------

def test_the_same_prompt_twice(tiny):
    p = prompt(1, 70)
    on, _, core = on_and_off(tiny, [(p, 12, 0, None), (p, 12, 40, None)])
    assert on[0][1].cached_tokens == 0 and on[1][1].cached_tokens == 64
    stats = core.stats()
    assert stats.prefix_cache_hits == 64 and stats.prefix_cache_queries == 140


@pytest.mark.parametrize("shared_blocks", [1, 2, 5])
def test_prompts_sharing_whole_blocks_then_differing_inside_one(tiny, shared_blocks):
    base = prompt(2, shared_blocks * BS + 30)
    cut = shared_blocks * BS + 5                               # they differ inside the next block
    other = base[:cut] + prompt(3, 25)
    on, _, _ = on_and_off(tiny, [(base, 10, 0, None), (other, 10, 30, None)])
    assert on[1][1].cached_tokens == shared_blocks * BS


def test_a_prefix_that_was_evicted_is_recomputed(tiny):
    first = prompt(4, 60)
    fillers = [(prompt(100 + i, 60), 4, 20 + 10 * i, None) for i in range(6)]
    requests = [(first, 8, 0, None), *fillers, (first, 8, 200, None)]
    on, _, core = on_and_off(tiny, requests, num_blocks=12)
    assert on[len(requests) - 1][1].cached_tokens < 48         # some of its blocks were evicted meanwhile
    assert on[1][1].cached_tokens == 0


def test_a_chunked_prefill_continues_after_the_cached_prefix(tiny):
    p = prompt(5, 150)
    on, _, _ = on_and_off(tiny, [(p, 6, 0, None), (p[:120] + prompt(6, 40), 6, 30, None)],
                          max_prefill_tokens=32)
    assert on[1][1].cached_tokens == 112


def test_300_random_requests_with_shared_prefixes_aborts_and_preemption(tiny):
    rng = random.Random(21)
    roots = [prompt(1000 + i, 48) for i in range(5)]
    requests = []
    for i in range(300):
        root = rng.choice(roots)
        keep = rng.choice([0, 5, 16, 20, 32, 40, 48])
        own = prompt(5000 + i, rng.randint(1, 20))
        abort_after = rng.randint(1, 4) if rng.random() < 0.1 else None
        requests.append((root[:keep] + own, rng.randint(1, 40), i // 6, abort_after))
    on, off, core = on_and_off(tiny, requests, num_blocks=36, max_batch=12, max_prefill_tokens=96)
    stats = core.stats()
    assert stats.preemptions > 0
    assert stats.prefix_cache_hits > 0.2 * stats.prefix_cache_queries
    reasons = [finish.reason for _, finish in on.values()]
    assert reasons.count("abort") > 10 and "error" not in reasons
    first_time = sum(finish.cached_tokens for _, finish in on.values())
    assert stats.prefix_cache_hits > first_time                # resumed requests found their blocks again
    assert stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0


def test_a_cache_salt_isolates_and_changes_no_token(tiny):
    core, p = make_core(tiny, True), prompt(8, 70)

    def answer(name, salt):
        events = []
        core.publish = lambda pairs, stats: events.extend(e for _, e in pairs)
        core.add(name, p, SamplingParams(max_new_tokens=8, ignore_eos=True, cache_salt=salt), seed=0)
        core.run_until_idle()
        return [e.token_id for e in events if not isinstance(e, FinishEvent)], events[-1].cached_tokens

    plain, cached = answer("plain", None)
    assert cached == 0
    assert answer("a1", "a") == (plain, 0)
    assert answer("a2", "a") == (plain, 64)
    assert answer("b", "b") == (plain, 0)
    assert answer("plain again", None) == (plain, 64)
    core.blocks.check([])


def test_a_failed_prefill_leaves_nothing_cached_and_the_pool_whole(tiny):
    core = make_core(tiny, True)
    p = prompt(7, 50)
    prefill = core.runner.prefill

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    core.runner.prefill = broken
    core.add("a", p, SamplingParams(max_new_tokens=4, ignore_eos=True), seed=0)
    with pytest.raises(RuntimeError):
        core.step()
    core.runner.pipeline.drop()
    core.fail_all("injected")
    core.blocks.check([])
    assert core.blocks.num_cached_idle == 0 and core.blocks.num_free == core.blocks.num_blocks
    core.runner.prefill = prefill
    again = drive(core, [(p, 4, 0, None), (p, 4, 10, None)])
    assert again[0][1].reason == "length" and again[0][1].cached_tokens == 0
    assert again[1][1].cached_tokens == 48


def test_no_prefix_caching_flag_turns_it_off(monkeypatch):
    from server.cli import engine_options, parse_args
    monkeypatch.delenv("FLASHDECODE_NO_PREFIX_CACHING", raising=False)
    assert "prefix_caching" not in engine_options(parse_args([]))
    assert EngineConfig().prefix_caching is True
    assert engine_options(parse_args(["--no-prefix-caching"]))["prefix_caching"] is False
    monkeypatch.setenv("FLASHDECODE_NO_PREFIX_CACHING", "1")
    assert engine_options(parse_args([]))["prefix_caching"] is False


def test_the_start_up_log_says_whether_caching_is_on(tiny, caplog):
    with caplog.at_level("INFO", logger="server.engine.core"):
        make_core(tiny, True)
        make_core(tiny, False)
    lines = [r.getMessage() for r in caplog.records if "prefix caching" in r.getMessage()]
    assert lines[0].startswith("prefix caching on") and lines[1] == "prefix caching off"


def test_prefill_after_a_cached_prefix_through_the_padded_graph_path_matches_the_packed_one(tiny):
    """The padded path the prefill graphs replay on a GPU (key rows gathered from the cache, one
    padding sequence), run eagerly: the logits of chunks after cached prefixes and the cache."""
    from server.engine.model_runner import ModelRunner

    def run(buckets):
        runner = ModelRunner(tiny, EngineConfig(max_batch=4, num_blocks=64, block_size=BS, prefill_graph_buckets=buckets),
                             max_model_len=512)
        blocks = BlockManager(runner.num_blocks, BS, True)
        first = seq_of(prompt(30, 100), "first")
        blocks.grow(first.block_table, first.length)
        runner.prefill([(first, first.length)])
        first.num_cached = first.length
        blocks.commit(first)
        chunks = []
        for i, (keep, own) in enumerate([(100, 7), (40, 30), (0, 12)]):
            seq = seq_of(first.prompt_ids[:keep] + prompt(40 + i, own), f"s{i}")
            seq.num_cached = blocks.match(seq)
            blocks.grow(seq.block_table, seq.length)
            chunks.append((seq, seq.length - seq.num_cached))
        assert [s.num_cached for s, _ in chunks] == [96, 32, 0]
        with torch.inference_mode():
            shape = runner.prefill_graphs.bucket_for(chunks) if runner.prefill_graphs else None
            return runner.prefill(chunks), runner.kv_caches[1][0].clone(), shape

    padded, padded_cache, shape = run((16, 64))
    packed, packed_cache, _ = run(())
    assert shape == (64, 1024)                                 # 11 + 38 + 12 = 61 rows; 107 + 70 + 12 + 3 keys
    assert torch.allclose(padded, packed, atol=1e-5, rtol=1e-5)
    assert torch.allclose(padded_cache, packed_cache, atol=1e-6)


def test_caching_on_and_off_give_the_same_tokens_through_the_prefill_graph_path(tiny):
    base = prompt(50, 70)
    requests = [(base, 8, 0, None), (base[:40] + prompt(51, 9), 8, 20, None), (base, 8, 20, None),
                (prompt(52, 30), 8, 21, None)]
    outputs = []
    for caching in (True, False):
        core = EngineCore(tiny, EngineConfig(max_batch=4, num_blocks=64, block_size=BS, prefix_caching=caching,
                                             prefill_graph_buckets=(16, 64, 128)), publish=lambda p, s: None)
        out = drive(core, requests, check_every_step=True)
        outputs.append([tokens for tokens, _ in out.values()])
        if caching:
            assert [finish.cached_tokens for _, finish in out.values()] == [0, 32, 64, 0]
    assert outputs[0] == outputs[1]
