"""The load generator: its metrics, arrivals, stream parsing and prompts in isolation; whole runs
against a small fake streaming server (fast, exact expectations); and runs against the real server
on the embedded model (the shared ``live_server`` fixture of conftest.py), whose token counts must
match what the server reports."""

import json
import math
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from load_tests import loadgen
from load_tests.backends import OpenAIChatBackend, OpenAICompletionsBackend, TGIBackend
from load_tests.metrics import RequestResult, parse_slos, percentile, summarize
from load_tests.prompts import PromptSource
from tests.conftest import metric_value

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- metrics

def test_percentile_interpolates_like_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    values = [rng.expovariate(1.0) for _ in range(101)]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))


def _result(ttft, latency, n_tokens, reported=None, ok=True, max_tokens=None):
    gap = (latency - ttft) / (n_tokens - 1) if n_tokens > 1 else 0.0
    return RequestResult(prompt_len=10, max_tokens=max_tokens or n_tokens, ok=ok, ttft=ttft, latency=latency,
                         itl=[gap] * (n_tokens - 1), tokens_counted=n_tokens,
                         tokens_reported=n_tokens if reported is None else reported,
                         prompt_tokens_reported=10, error=None if ok else "boom")


def test_summary_follows_the_vllm_definitions():
    results = [_result(0.1, 1.1, 11), _result(0.3, 2.3, 11), _result(0.2, 0.2, 1),
               _result(0.0, 0.5, 0, ok=False)]
    s = summarize(results, duration=4.0, percentiles=[50, 99], slos={"ttft": 250.0, "tpot": 150.0},
                  expect_length=True)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["total_output_tokens"] == 23 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(3 / 4.0)
    assert s["output_throughput"] == pytest.approx(23 / 4.0)
    assert s["total_token_throughput"] == pytest.approx(53 / 4.0)
    # TPOT of the two 11-token requests: 100 ms and 200 ms (one-token requests have none).
    assert s["tpot_ms"]["count"] == 2 and s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"]["count"] == 20 and s["itl_ms"]["mean"] == pytest.approx(150.0)
    assert s["e2el_ms"]["max"] == pytest.approx(2300.0)
    # Goodput: the first (TTFT 100, TPOT 100) and the one-token request (TTFT 200, TPOT 0) pass;
    # the second misses both bounds, the failed one counts against attainment.
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["slo_attainment"] == pytest.approx(2 / 4)
    assert s["errors"] == {"boom": 1}


def test_token_check_flags_disagreeing_and_short_counts():
    results = [_result(0.1, 1.0, 8), _result(0.1, 1.0, 8, reported=9), _result(0.1, 1.0, 5, max_tokens=8)]
    check = summarize(results, 1.0, [50], {}, expect_length=True)["token_check"]
    assert check["checked"] == 3 and check["mismatched"] == 1 and check["not_requested_length"] == 2
    # Where a chunk may carry several tokens, fewer streamed than reported is no mismatch; more is.
    results.append(_result(0.1, 1.0, 8, reported=7))
    check = summarize(results, 1.0, [50], {}, expect_length=False, exact_count=False)["token_check"]
    assert (check["mismatched"], check["multi_token_chunks"], check["not_requested_length"]) == (1, 1, 0)


@pytest.mark.parametrize("spec", [["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:fast"]])
def test_bad_slos_are_rejected(spec):
    with pytest.raises(ValueError):
        parse_slos(spec)


def test_slos_parse():
    assert parse_slos(["TTFT:500", "tpot:50", "e2el:2e4"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 20000.0}


# ----------------------------------------------------------------------------- arrivals

def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_burstiness():
    for burstiness in (1.0, 0.25, 4.0):
        gaps = loadgen.arrival_gaps(20000, 50.0, burstiness, random.Random(3))
        mean = sum(gaps) / len(gaps)
        var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
        assert mean == pytest.approx(1 / 50.0, rel=0.05)
        # Gamma with shape k: squared coefficient of variation 1/k (1 for Poisson arrivals).
        assert var / mean ** 2 == pytest.approx(1 / burstiness, rel=0.15)
    assert loadgen.arrival_gaps(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5


# ----------------------------------------------------------------------------- stream parsing

def _events(*objs, t0=1.0, dt=0.01):
    return [(t0 + i * dt, json.dumps(o).encode()) for i, o in enumerate(objs)]


def test_tgi_stream_parsing():
    tok = lambda i, text, special=False: {"token": {"id": i, "text": text, "logprob": -0.1, "special": special},
                                          "generated_text": None, "details": None}
    last = tok(3, "!") | {"generated_text": "Hi there!", "details": {"finish_reason": "length",
                                                                     "generated_tokens": 3, "input_length": 7}}
    parsed = TGIBackend().parse(_events(tok(1, "Hi"), tok(2, " there"), last))
    assert len(parsed.token_times) == 3 and parsed.text == "Hi there!"
    assert (parsed.completion_tokens, parsed.prompt_tokens, parsed.finish_reason) == (3, 7, "length")

    # A closing placeholder (empty special token that the server does not count) is no token.
    closing = tok(2, "", special=True) | {"generated_text": "Hi there", "details": {
        "finish_reason": "length", "generated_tokens": 2, "input_length": 7}}
    parsed = TGIBackend().parse(_events(tok(1, "Hi"), tok(2, " there"), closing))
    assert len(parsed.token_times) == parsed.tokens == 2 and parsed.completion_tokens == 2

    parsed = TGIBackend().parse(_events(tok(1, "Hi"), {"error": "generation failed", "error_type": "generation"}))
    assert parsed.error == "generation failed"


def test_openai_stream_parsing():
    chunk = lambda text, finish=None: {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    events = _events(chunk("A"), chunk(""), chunk(" b"), chunk("", "length"),
                     {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    parsed = OpenAICompletionsBackend(model="m").parse(events)
    assert len(parsed.token_times) == parsed.tokens == 3 and parsed.text == "A b"
    assert (parsed.completion_tokens, parsed.prompt_tokens, parsed.finish_reason) == (3, 5, "length")

    delta = lambda d, finish=None: {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}
    events = _events(delta({"role": "assistant", "content": ""}), delta({"content": "Paris"}),
                     delta({"content": "."}, "stop"), {"choices": [], "usage": {"completion_tokens": 2}})
    parsed = OpenAIChatBackend(model="m").parse(events)
    assert len(parsed.token_times) == 2 and parsed.text == "Paris." and parsed.completion_tokens == 2
    assert parsed.tokens == 2

    # With logprobs each chunk lists its tokens: a chunk carrying two tokens counts two.
    lp = lambda text, *tokens, finish=None: {"choices": [{"index": 0, "text": text, "finish_reason": finish,
                                                          "logprobs": {"tokens": list(tokens)}}]}
    backend = OpenAICompletionsBackend(model="m", logprobs=True)
    assert backend.exact_count and not OpenAICompletionsBackend(model="m").exact_count
    parsed = backend.parse(_events(lp("A", "A"), lp("\u00e9b", "\u00e9", "b"), lp("", finish="length"),
                                   {"choices": [], "usage": {"completion_tokens": 3}}))
    assert (parsed.tokens, len(parsed.token_times), parsed.completion_tokens) == (3, 2, 3)

    parsed = OpenAICompletionsBackend(model="m").parse(_events({"error": {"message": "too long", "code": 400}}))
    assert parsed.error == "too long"


def test_request_bodies():
    body = TGIBackend(ignore_eos=True).body("hi", 12)
    assert body["inputs"] == "hi" and body["parameters"]["max_new_tokens"] == 12
    assert body["parameters"]["ignore_eos"] is True and body["parameters"]["do_sample"] is False
    assert "ignore_eos" not in TGIBackend(ignore_eos=False).body("hi", 12)["parameters"]
    body = OpenAICompletionsBackend(model="m", temperature=0.5).body("hi", 12)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"]) == (12, 0.5, True)
    assert OpenAIChatBackend(model="m").body("hi", 3)["messages"] == [{"role": "user", "content": "hi"}]
    assert OpenAICompletionsBackend(model="m", logprobs=True).body("hi", 3)["logprobs"] == 1
    assert OpenAIChatBackend(model="m", logprobs=True).body("hi", 3)["logprobs"] is True


# ----------------------------------------------------------------------------- prompts

class CorpusWordTokenizer:
    """One token per word: lengths are checkable by hand."""

    def __init__(self, words):
        self.vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
        self.words = list(self.vocab)

    def encode(self, text, add_special_tokens=False):
        return [self.vocab[w] for w in text.split()]

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


def test_prompts_have_the_exact_length_with_a_tokenizer():
    from load_tests.prompts import CORPUS
    source = PromptSource(CorpusWordTokenizer(CORPUS.split()), seed=0)
    n_corpus = len(source.ids)
    for length in (1, 7, 128, n_corpus + 50):        # longer than the corpus wraps around
        text = source.make(length)
        assert len(text.split()) == length
    prompts = source.batch(20, 100, range_ratio=0.5)
    assert all(50 <= n <= 150 and len(text.split()) == n for text, n in prompts)
    assert len({text for text, _ in prompts}) == 20               # no shared prompt


def test_prompts_without_a_tokenizer_follow_the_calibrated_ratio():
    source = PromptSource(None, seed=0)
    assert not source.exact
    n_words = len(source.make(130).split())
    assert n_words == round(130 / 1.3)
    source.calibrate("one two three four", 8)                       # the server counted 2 tokens a word
    assert len(source.make(100).split()) == 50
    with pytest.raises(ValueError):
        source.make(0)


# ----------------------------------------------------------------------------- safety and inputs

def test_only_loopback_targets_without_allow_remote():
    assert loadgen.is_loopback("127.0.0.1") and loadgen.is_loopback("127.5.6.7")
    assert loadgen.is_loopback("[::1]") and loadgen.is_loopback("localhost")
    assert not loadgen.is_loopback("10.0.0.1") and not loadgen.is_loopback("192.168.1.2")
    with pytest.raises(SystemExit, match="loopback"):
        loadgen.main(["--base-url", "http://10.0.0.1:8000", "--concurrency", "1", "--tokenizer", "none"])


@pytest.mark.parametrize("argv", [[], ["--concurrency", "1", "--request-rate", "1"], ["--concurrency", "0"],
                                  ["--request-rate", "-1"]])
def test_load_mode_must_be_one_valid_choice(argv):
    with pytest.raises(SystemExit):
        loadgen.main(["--tokenizer", "none", *argv])


def test_engine_json_rows(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"ours": [{"batch": 1, "tok_per_s": 300.5}, {"batch": 16, "tok_per_s": 4000}],
                                "peers": {"hf": []}}))
    assert loadgen.load_engine_rows(str(path)) == {1: 300.5, 16: 4000.0}
    assert loadgen.load_engine_rows(None) == {}
    # As load_tests/engine_bench.py writes them: long-context rows repeat batch sizes.
    path.write_text(json.dumps({"ours": [
        {"batch": 1, "prompt_len": 128, "new_tokens": 256, "tok_per_s": 300.0},
        {"batch": 16, "prompt_len": 128, "new_tokens": 256, "tok_per_s": 4000.0},
        {"batch": 1, "prompt_len": 32768, "new_tokens": 128, "tok_per_s": 90.0}]}))
    assert loadgen.load_engine_rows(str(path), 128, 256) == {1: 300.0, 16: 4000.0}
    assert loadgen.load_engine_rows(str(path), 32768, 128) == {1: 90.0}
    assert loadgen.load_engine_rows(str(path), 64, 64) == {}
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="ours"):
        loadgen.load_engine_rows(str(path))


# ----------------------------------------------------------------------------- a fake server

def _fake_app(state):
    """TGI and OpenAI streaming endpoints that emit ``max_tokens`` tokens, 2 ms apart."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def sse(obj):
        return f"data: {json.dumps(obj)}\n\n"

    async def generate_stream(request):
        body = await request.json()
        n = body["parameters"]["max_new_tokens"]
        state["tgi_bodies"].append(body)

        async def events():
            for i in range(n - 1 if state["cut"] else n):
                await asyncio.sleep(0.002)
                event = {"index": i + 1, "token": {"id": i, "text": f" w{i}", "logprob": 0.0, "special": False},
                         "generated_text": None, "details": None}
                if i == n - 1:
                    event["generated_text"] = "".join(f" w{j}" for j in range(n))
                    event["details"] = {"finish_reason": "length", "input_length": len(body["inputs"].split()),
                                        "generated_tokens": n + state["misreport"],
                                        "cached_tokens": len(body["inputs"].split()) // 2}
                yield sse(event)
        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request):
        body = await request.json()
        n = body["max_tokens"]

        async def chunks():
            for i in range(n):
                await asyncio.sleep(0.002)
                yield sse({"choices": [{"index": 0, "text": f" w{i}",
                                        "finish_reason": "length" if i == n - 1 else None}]})
            yield sse({"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()),
                                                "completion_tokens": n + state["misreport"]}})
            yield "data: [DONE]\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/generate_stream", generate_stream, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    state = {"misreport": 0, "cut": False, "tgi_bodies": []}
    port = loadgen.free_port()
    server = uvicorn.Server(uvicorn.Config(_fake_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


def _run(base_url, out_dir, *extra):
    argv = ["--base-url", base_url, "--tokenizer", "none", "--no-progress", "--out-dir", str(out_dir),
            "--input-len", "24", "--output-len", "6", "--warmup", "1", *extra]
    return loadgen.main(argv)


def _load(out_dir):
    return json.loads((Path(out_dir) / "results.json").read_text())


def _check_outputs(out_dir):
    for name in ("results.json", "report.md", "throughput.png", "latency.png"):
        path = Path(out_dir) / name
        assert path.is_file() and path.stat().st_size > 0, name
    for name in ("throughput.png", "latency.png"):
        assert (Path(out_dir) / name).read_bytes()[:8] == PNG_MAGIC


def test_concurrency_sweep_against_a_fake_server(fake_server, tmp_path):
    base_url, state = fake_server
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps({"ours": [{"batch": 1, "tok_per_s": 1.0}, {"batch": 4, "tok_per_s": 1e9}]}))
    rc = _run(base_url, tmp_path, "--concurrency", "1,4", "--num-prompts", "8", "--goodput", "ttft:1000",
              "--engine-json", str(engine))
    assert rc == 0
    _check_outputs(tmp_path)
    doc = _load(tmp_path)
    assert [lv["level"]["concurrency"] for lv in doc["levels"]] == [1, 4]
    for lv in doc["levels"]:
        s = lv["summary"]
        assert s["completed"] == 8 and s["failed"] == 0 and s["total_output_tokens"] == 48
        check = s["token_check"]
        assert check["exact"] and check["checked"] == 8 and check["not_reported"] == 0
        assert check["mismatched"] == check["not_requested_length"] == 0 and check["examples"] == []
        assert len(lv["requests"]) == 8
        assert all(r["tokens_counted"] == r["tokens_reported"] == 6 for r in lv["requests"])
        assert all(len(r["itl"]) == 5 and r["ttft"] > 0 for r in lv["requests"])
        assert s["itl_ms"]["p50"] >= 1.5            # the fake server sleeps 2 ms between tokens
        assert s["goodput"] == pytest.approx(s["request_throughput"])
    # ignore_eos and greedy decoding were asked for.
    assert all(b["parameters"]["ignore_eos"] and not b["parameters"]["do_sample"] for b in state["tgi_bodies"])
    # The engine comparison: batch 1 is far above 1 tok/s, batch 4 far below 1e9 tok/s.
    e1, e4 = (lv["summary"]["engine"] for lv in doc["levels"])
    assert e1["meets_target"] and not e4["meets_target"] and e4["target"] == 0.6
    md = (tmp_path / "report.md").read_text()
    assert "| concurrency | requests ok | req/s | output tok/s | engine tok/s (batch = c) |" in md
    assert "| 4 | 8/8 |" in md and "**no**" in md and "goodput" in md
    assert "![throughput](throughput.png)" in md


def test_shared_prefix_and_multi_turn_prompts_and_the_cached_share(fake_server, tmp_path):
    base_url, state = fake_server
    state["tgi_bodies"].clear()
    rc = _run(base_url, tmp_path / "shared", "--concurrency", "2", "--num-prompts", "4", "--shared-prefix", "40",
              "--no-plots")
    assert rc == 0
    inputs = [b["inputs"] for b in state["tgi_bodies"]]
    assert len(inputs) == 5                                    # the warm-up and four requests
    prefix = inputs[0].split()[:30]                            # ~40 tokens: 30 words at 1.3 tokens a word
    assert all(text.split()[:30] == prefix for text in inputs)
    assert len({text for text in inputs}) == 5                 # then each its own
    doc = _load(tmp_path / "shared")
    assert doc["config"]["shared_prefix"] == 40
    assert doc["levels"][0]["summary"]["cached_prompt_share"] == pytest.approx(0.5, abs=0.05)
    md = (tmp_path / "shared" / "report.md").read_text()
    assert "the same 40 tokens" in md and "prompt tokens cached" in md

    state["tgi_bodies"].clear()
    rc = _run(base_url, tmp_path / "chat", "--concurrency", "2", "--num-prompts", "6", "--multi-turn", "3",
              "--no-plots")
    assert rc == 0
    turns = [b["inputs"] for b in state["tgi_bodies"][1:]]    # after the warm-up
    answer = "".join(f" w{i}" for i in range(6))
    firsts = [t for t in turns if answer not in t]
    assert len(firsts) == 2                                    # two conversations of three turns
    for first in firsts:
        second = next(t for t in turns if t.startswith(first + answer + "\n\n") and t.count(answer) == 1)
        assert any(t.startswith(second + answer + "\n\n") and t.count(answer) == 2 for t in turns)
    doc = _load(tmp_path / "chat")
    (level,) = doc["levels"]
    assert level["summary"]["completed"] == 6
    assert sorted(r["prompt_len"] for r in level["requests"])[-1] > 2 * 24
    assert "conversations of 3 turns" in (tmp_path / "chat" / "report.md").read_text()


def test_output_lengths_drawn_around_the_mean_and_each_request_checked_against_its_own(fake_server, tmp_path):
    base_url, state = fake_server
    state["tgi_bodies"].clear()
    rc = _run(base_url, tmp_path, "--concurrency", "4", "--num-prompts", "32", "--output-len", "20",
              "--output-range", "0.5", "--no-plots")
    assert rc == 0
    asked = [b["parameters"]["max_new_tokens"] for b in state["tgi_bodies"][1:]]   # after the warm-up
    assert len(asked) == 32 and all(10 <= n <= 30 for n in asked) and len(set(asked)) > 5
    assert state["tgi_bodies"][0]["parameters"]["max_new_tokens"] == 20            # the warm-up: the mean
    (level,) = _load(tmp_path)["levels"]
    assert sorted(r["max_tokens"] for r in level["requests"]) == sorted(asked)
    assert level["summary"]["token_check"]["not_requested_length"] == 0
    assert level["summary"]["total_output_tokens"] == sum(asked)
    md = (tmp_path / "report.md").read_text()
    assert "output: 20 tokens ±50%" in md and "generated exactly the tokens asked" in md


@pytest.mark.parametrize("flag", ["--input-range", "--output-range"])
def test_length_ranges_outside_zero_to_one_are_refused(flag, tmp_path):
    with pytest.raises(SystemExit, match=r"must be in \[0, 1\), not"):
        _run("http://127.0.0.1:9", tmp_path, "--concurrency", "1", flag, "1.0")


def test_request_rate_mode_with_openai_completions(fake_server, tmp_path):
    base_url, _ = fake_server
    rc = _run(base_url, tmp_path, "--backend", "openai", "--request-rate", "200,inf", "--burstiness", "0.5",
              "--max-concurrency", "3", "--num-prompts", "6", "--strict")
    assert rc == 0
    _check_outputs(tmp_path)
    doc = _load(tmp_path)
    assert doc["config"]["model"] == "fake-model"            # from /v1/models
    assert [lv["level"]["request_rate"] for lv in doc["levels"]] == [200.0, None]
    assert all(lv["summary"]["completed"] == 6 for lv in doc["levels"])
    # Prompts are calibrated from the server's count (here: one token per word).
    assert doc["config"]["tokens_per_word"] == pytest.approx(1.0)
    assert all(r["prompt_tokens_reported"] == 24 for lv in doc["levels"] for r in lv["requests"])


def test_levels_split_over_worker_processes_add_up():
    parts = loadgen.split_level(loadgen.Level("concurrency", concurrency=10), 3)
    assert [p.concurrency for p in parts] == [4, 3, 3]
    parts = loadgen.split_level(loadgen.Level("rate", request_rate=9.0, burstiness=0.5, max_concurrency=5), 2)
    assert [(p.request_rate, p.burstiness, p.max_concurrency) for p in parts] == [(4.5, 0.5, 3), (4.5, 0.5, 2)]


def test_several_client_processes(fake_server, tmp_path):
    base_url, _ = fake_server
    rc = _run(base_url, tmp_path, "--concurrency", "4", "--num-prompts", "8", "--workers", "2", "--strict",
              "--no-plots")
    assert rc == 0
    (level,) = _load(tmp_path)["levels"]
    assert level["summary"]["completed"] == 8 and len(level["requests"]) == 8
    # One clock for all processes: request start times lie inside the level's duration.
    assert all(0 <= r["start"] < level["summary"]["duration_s"] for r in level["requests"])


def test_disagreeing_token_counts_fail_a_strict_run(fake_server, tmp_path):
    base_url, state = fake_server
    state["misreport"] = 1
    try:
        rc = _run(base_url, tmp_path, "--concurrency", "2", "--num-prompts", "4", "--strict", "--no-plots")
    finally:
        state["misreport"] = 0
    assert rc == 1
    s = _load(tmp_path)["levels"][0]["summary"]
    assert s["token_check"]["mismatched"] == 4
    assert "streamed a different number of tokens" in (tmp_path / "report.md").read_text()


def test_a_stream_cut_off_before_its_end_is_a_failed_request(fake_server, tmp_path):
    base_url, state = fake_server
    state["cut"] = True
    try:
        rc = _run(base_url, tmp_path, "--concurrency", "2", "--num-prompts", "4", "--warmup", "0", "--strict",
                  "--no-plots")
    finally:
        state["cut"] = False
    assert rc == 1
    s = _load(tmp_path)["levels"][0]["summary"]
    assert s["failed"] == 4 and "cut off" in next(iter(s["errors"]))


def test_an_unreachable_server_fails_the_warm_up(tmp_path):
    rc = _run(f"http://127.0.0.1:{loadgen.free_port()}", tmp_path, "--concurrency", "1", "--num-prompts", "1",
              "--request-timeout", "5")
    assert rc == 1 and not (tmp_path / "results.json").exists()


# ----------------------------------------------------------------------------- the real server

def _metric(base_url: str, name: str) -> float:
    return metric_value(httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text, name)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tgi", "openai"])
def test_against_the_live_server_on_the_embedded_model(live_server, tmp_path, backend):
    generated_before = _metric(live_server, "llm_generation_tokens_total")
    prompt_before = _metric(live_server, "llm_prompt_tokens_total")
    # OpenAI streams leave out tokens whose text is still empty: logprobs make the count exact.
    exact = ["--logprobs"] if backend == "openai" else []
    rc = loadgen.main(["--base-url", live_server, "--backend", backend, "--concurrency", "4",
                       "--num-prompts", "8", "--input-len", "16", "--output-len", "12", "--warmup", "0",
                       "--no-progress", "--strict", "--out-dir", str(tmp_path), *exact])
    assert rc == 0
    _check_outputs(tmp_path)
    doc = _load(tmp_path)
    (level,) = doc["levels"]
    s = level["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    # Every request streamed as many tokens as the server says it generated, and exactly the
    # 12 asked for (ignore_eos); the prompts have the token length asked for.
    for r in level["requests"]:
        assert r["tokens_counted"] == r["tokens_reported"] == 12, r
        assert r["prompt_tokens_reported"] == 16, r
        assert len(r["itl"]) == 11 and 0 < r["ttft"] <= r["latency"]
    assert s["total_output_tokens"] == 96
    # ... and the server's own counters saw the same totals.
    assert _metric(live_server, "llm_generation_tokens_total") - generated_before == 96
    assert _metric(live_server, "llm_prompt_tokens_total") - prompt_before == 8 * 16
    md = (tmp_path / "report.md").read_text()
    assert "| 4 | 8/8 |" in md and "8 of those match the tokens streamed" in md


@pytest.mark.slow
def test_a_shared_prefix_is_served_from_the_live_servers_cache(live_server, tmp_path):
    rc = loadgen.main(["--base-url", live_server, "--concurrency", "1", "--num-prompts", "3", "--input-len", "16",
                       "--output-len", "2", "--shared-prefix", "300", "--warmup", "1", "--no-progress", "--no-plots",
                       "--out-dir", str(tmp_path)])
    level = _load(tmp_path)["levels"][0]
    got = [(r["ok"], r["error"], r["prompt_tokens_reported"], r["cached_tokens_reported"]) for r in level["requests"]]
    assert rc == 0 and level["summary"]["completed"] == 3, got
    assert all(cached >= 256 for _, _, _, cached in got), got                   # two blocks of 128
    assert level["summary"]["cached_prompt_share"] > 0.7, got


@pytest.mark.slow
def test_serve_starts_and_stops_the_server(tmp_path):
    rc = loadgen.main(["--serve", "--model default --device cpu", "--concurrency", "1", "--num-prompts", "2",
                       "--input-len", "8", "--output-len", "4", "--warmup", "0", "--no-progress", "--no-plots",
                       "--strict", "--out-dir", str(tmp_path)])
    assert rc == 0
    doc = _load(tmp_path)
    assert doc["config"]["base_url"].startswith("http://127.0.0.1:")
    assert doc["levels"][0]["summary"]["completed"] == 2
    assert (tmp_path / "server.log").stat().st_size > 0
    # The server is gone once the run is over.
    with pytest.raises(httpx.ConnectError):
        httpx.get(doc["config"]["base_url"] + "/health", timeout=2, trust_env=False)


@pytest.mark.slow
def test_serve_reports_a_server_that_cannot_load_its_model(tmp_path):
    started = time.monotonic()
    rc = loadgen.main(["--serve", f"--model {tmp_path / 'missing.gguf'} --device cpu", "--concurrency", "1",
                       "--no-progress", "--out-dir", str(tmp_path), "--serve-timeout", "120"])
    assert rc == 1 and not (tmp_path / "results.json").exists()
    assert time.monotonic() - started < 60          # told by /health, not by the time-out


def test_serve_reports_a_server_that_exits_at_once(tmp_path, caplog):
    rc = loadgen.main(["--serve", "--api-workers not-a-number", "--concurrency", "1",
                       "--no-progress", "--out-dir", str(tmp_path), "--serve-timeout", "60"])
    assert rc == 1
    assert "the server exited with code" in caplog.text and "not-a-number" in caplog.text


def test_a_request_left_unparsed_parses_later_to_the_same_result(fake_server):
    """A closed loop's last turn is parsed after the level (its client sends the next request
    first): the result completed then equals one parsed at once."""
    import asyncio

    import aiohttp

    from load_tests.backends import TGIBackend

    base_url, _ = fake_server
    backend = TGIBackend()

    async def both():
        async with aiohttp.ClientSession() as client:
            url = base_url + backend.path
            now = await loadgen.send_request(client, backend, url, "hello there", 2, 6, {}, time.perf_counter())
            later = await loadgen.send_request(client, backend, url, "hello there", 2, 6, {}, time.perf_counter(),
                                               parse=False)
            return now, later

    now, later = asyncio.run(both())
    assert isinstance(later, loadgen.Unparsed) and not later.result.ok and later.events
    done = loadgen.parse_result(later, backend)
    assert done is later.result and done.ok and now.ok
    for field in ("tokens_counted", "tokens_reported", "text", "finish_reason", "chunks"):
        assert getattr(done, field) == getattr(now, field), field
    assert done.ttft > 0 and len(done.itl) == len(now.itl) == 5
