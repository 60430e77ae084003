"""Text on the front end's side of the core: detokenizing, stop strings, and what a stop does."""

import time

import pytest

from models import load_model
from server.engine import Engine, EngineConfig, FinishEvent, SamplingParams, TokenEvent
from server.engine.output import OutputProcessor

from .helpers import check_one_request_fails_then_the_engine_serves, failing_on_second_call, run_all


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny", dtype="float32", device="cpu")


def token(token_id, last=False, special=False):
    return TokenEvent(token_id, "", None, special, 0.0, last)


def finish(reason, completion_tokens):
    return FinishEvent(reason, "", 3, completion_tokens, None, {"total": 1.0})


def feed(processor, request_id, token_ids, last_at=None):
    """One step per token; returns the text events and the aborts asked for."""
    out, aborts = [], []
    for n, t in enumerate(token_ids):
        events, stopped = processor.process([(request_id, token(t, last=n == last_at))])
        out += events
        aborts += stopped
    return out, aborts


def test_text_matches_a_whole_decode_and_the_finish_carries_it(tiny):
    tok = tiny.tokenizer
    ids = tok("Grüße aus Köln 🚀 und Tokyo")["input_ids"]
    processor = OutputProcessor(tok)
    processor.add("r", [1, 2, 3], SamplingParams())
    events, aborts = feed(processor, "r", ids, last_at=len(ids) - 1)
    [(_, done)], _ = processor.process([("r", finish("length", len(ids)))])
    streamed = "".join(e.text for _, e in events)
    assert streamed == tok.decode(ids, skip_special_tokens=True) == done.text
    assert not aborts and done.reason == "length" and done.completion_tokens == len(ids)
    assert len(processor) == 0


def test_a_stop_string_ends_the_request_at_once_and_asks_the_core_to_abort(tiny):
    tok = tiny.tokenizer
    ids = tok(" alpha beta gamma delta epsilon")["input_ids"]
    processor = OutputProcessor(tok)
    processor.add("r", [1, 2, 3], SamplingParams(stop=("mma d",)))
    events, aborts = feed(processor, "r", ids)
    tokens = [e for _, e in events if isinstance(e, TokenEvent)]
    done = events[-1][1]
    assert isinstance(done, FinishEvent) and aborts == ["r"]
    streamed = "".join(t.text for t in tokens)
    assert streamed == done.text == " alpha beta ga"
    assert tokens[-1].last and not any(t.last for t in tokens[:-1])
    assert len(tokens) < len(ids)                   # tokens after the one completing the stop are dropped
    assert done.reason == "stop" and done.completion_tokens == len(tokens) and done.prompt_tokens == 3
    assert done.timings["ttft"] >= 0 and done.timings["total"] >= 0
    assert "r" in processor                          # in flight until the core's own finish
    assert processor.process([("r", token(5)), ("r", finish("abort", len(ids)))]) == ([], [])
    assert "r" not in processor and len(processor) == 0


def test_a_stop_string_ends_the_text_only_after_min_tokens(tiny):
    """As vLLM: the first ``min_tokens`` tokens' text is not searched for stop strings (they end
    with the token after); a stop string within them stays in the text."""
    tok = tiny.tokenizer
    ids = tok(" ab cd ab cd ab cd ab cd")["input_ids"]
    first = next(n for n in range(1, len(ids) + 1) if "cd" in tok.decode(ids[:n]))
    later = next(n for n in range(first + 1, len(ids) + 1) if tok.decode(ids[:n]).count("cd") == 2)
    for min_tokens, ends_at in ((0, first), (first - 1, first), (first, later)):
        processor = OutputProcessor(tok)
        processor.add("r", [1], SamplingParams(stop=("cd",), min_tokens=min_tokens, max_new_tokens=len(ids)))
        events, aborts = feed(processor, "r", ids)
        done = events[-1][1]
        assert aborts == ["r"] and done.reason == "stop" and done.completion_tokens == ends_at, min_tokens
        assert "".join(e.text for _, e in events[:-1]) == done.text == tok.decode(ids[:ends_at]).rsplit("cd", 1)[0]


def test_with_include_stop_str_in_output_the_text_ends_after_the_stop_string(tiny):
    tok = tiny.tokenizer
    ids = tok(" alpha beta gamma delta epsilon")["input_ids"]
    processor = OutputProcessor(tok)
    processor.add("r", [1, 2, 3], SamplingParams(stop=("mma d", "beta gamma x"), include_stop_str_in_output=True))
    events, aborts = feed(processor, "r", ids)
    done = events[-1][1]
    assert aborts == ["r"] and done.reason == "stop"
    assert "".join(e.text for _, e in events[:-1]) == done.text == " alpha beta gamma d"


def test_text_that_may_begin_a_stop_is_held_back_until_the_last_token(tiny):
    tok = tiny.tokenizer
    ids = tok(" one two thr")["input_ids"]
    processor = OutputProcessor(tok)
    processor.add("r", [1], SamplingParams(stop=("three",)))
    events, _ = feed(processor, "r", ids[:-1])
    so_far = tok.decode(ids[:-1], skip_special_tokens=True)
    assert "".join(e.text for _, e in events) == so_far[:len(so_far) - len("three") + 1]
    events += feed(processor, "r", ids[-1:], last_at=0)[0]
    assert "".join(e.text for _, e in events) == " one two thr"


def test_two_tokens_of_one_request_in_one_step_keep_their_order(tiny):
    tok = tiny.tokenizer
    ids = tok(" red green")["input_ids"]
    processor = OutputProcessor(tok)
    processor.add("r", [1], SamplingParams())
    events, _ = processor.process([("r", token(t)) for t in ids])
    assert "".join(e.text for _, e in events) == " red green"


def test_events_of_unknown_requests_are_dropped(tiny):
    processor = OutputProcessor(tiny.tokenizer)
    assert processor.process([("nobody", token(5)), ("nobody", finish("length", 1))]) == ([], [])


def test_a_stop_string_ends_the_request_in_the_engine_and_frees_its_blocks(tiny):
    engine = Engine(tiny, EngineConfig(max_batch=4, num_blocks=32, block_size=16))
    engine.start()
    try:
        prompt = [5, 6, 7, 8]
        (tokens, text, full), = run_all(engine, [(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))])
        words = text.split()
        assert full.reason == "length" and len(words) > 6, text
        stop = words[len(words) // 2]
        expected = text[:text.index(stop)]
        params = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=(stop,))
        (cut_tokens, cut_text, done), = run_all(engine, [(prompt, params)])
        assert done.reason == "stop" and cut_text == done.text == expected
        assert done.completion_tokens == len(cut_tokens) < len(tokens) and cut_tokens == tokens[:len(cut_tokens)]
        for _ in range(200):                           # the core's own finish follows the abort
            if len(engine.output) == 0:
                break
            time.sleep(0.01)
        stats = engine.stats()
        assert len(engine.output) == 0 and stats.running == stats.waiting == 0
        assert engine.core.blocks.num_free == engine.core.blocks.num_blocks
    finally:
        engine.shutdown()


def test_an_end_of_sequence_token_prints_nothing(tiny):
    engine = Engine(tiny, EngineConfig(max_batch=2, num_blocks=16, block_size=16))
    engine.core.eos_ids = set(range(len(tiny.tokenizer)))        # whatever comes first ends it
    engine.start()
    try:
        (tokens, text, done), = run_all(engine, [([5, 6, 7], SamplingParams(max_new_tokens=8))])
        assert done.reason == "eos" and len(tokens) == 1 and text == done.text == ""
    finally:
        engine.shutdown()


def test_a_failure_making_text_fails_those_requests_and_the_engine_keeps_serving(tiny):
    engine = Engine(tiny, EngineConfig(max_batch=2, num_blocks=16, block_size=16))
    engine.output.process = failing_on_second_call(engine.output.process)
    engine.start()
    try:
        check_one_request_fails_then_the_engine_serves(engine)
        assert engine.core.blocks.num_free == engine.core.blocks.num_blocks and len(engine.output) == 0
    finally:
        engine.shutdown()
