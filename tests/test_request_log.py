"""load_tests.request_log: each request's legs put back on one clock from the server's request log."""

import json
import random

import pytest

from load_tests.request_log import bursts, prefill_groups, read, report, timeline


def record(rng, sent, worker, step_end):
    """A request log line for a request whose legs are drawn at random and whose first token
    leaves the engine at ``step_end``; returns it and the legs."""
    way_in, tokenize, to_engine, delivery = (rng.uniform(1e-4, 3e-3) for _ in range(4))
    arrival = sent + way_in + tokenize + to_engine
    queue = rng.uniform(0, step_end - arrival)
    fields = {"msg": "request finished", "engine_request_id": f"{worker}:r{rng.random()}", "request_start": sent,
              "request_to_tokenize_s": way_in, "tokenize_s": tokenize,
              "first_token_s": to_engine + (step_end - arrival) + delivery, "ttft_s": step_end - arrival,
              "queue_s": queue, "first_token_delivery_s": delivery, "total_s": 1.0}
    legs = {"way_in": way_in, "tokenize": tokenize, "to_engine": to_engine, "queue": queue,
            "prefill": step_end - arrival - queue, "delivery": delivery,
            "server_ttft": step_end + delivery - sent}
    return fields, legs


def test_the_legs_come_back_from_a_log_line():
    rng = random.Random()
    for _ in range(50):
        sent = 1.7e9 + rng.uniform(0, 100)
        fields, legs = record(rng, sent, rng.randrange(4), sent + rng.uniform(0.01, 0.02))
        t = timeline(fields)
        for leg, value in legs.items():
            assert getattr(t, leg) == pytest.approx(value, abs=1e-6), leg      # epoch seconds: ~0.2 us apart
        assert t.worker == fields["engine_request_id"].split(":")[0]
    assert timeline({"msg": "request finished", "tokenize_s": 0.001}) is None     # sent without X-Request-Start


def test_bursts_prefill_groups_and_the_report(tmp_path):
    rng = random.Random()
    lines, start = [], 1.7e9
    for burst in range(3):                                   # three bursts of five, 50 ms apart
        first = start + 0.05 * burst
        for i in range(5):                                   # served by two prefill steps: 2 and 3 requests
            step_end = first + (0.020 if i < 2 else 0.030) + rng.uniform(0, 2e-4)     # the logs' rounding
            fields, _ = record(rng, first + 0.001 * i, i % 2, step_end)
            lines.append(json.dumps(fields))
    lines.insert(3, json.dumps({"msg": "engine ready"}))
    lines.insert(5, "not json")
    path = tmp_path / "server.log"
    path.write_text("\n".join(lines) + "\n")
    timelines = read([path])
    assert len(timelines) == 15
    assert [len(run) for run in bursts(timelines, 0.003)] == [5, 5, 5]
    assert [len(run) for run in bursts(timelines, 0.0005)] == [1] * 15
    assert prefill_groups(timelines) == {2: 3, 3: 3}
    text = report(timelines)
    assert "15 requests; per API worker: 0: 9, 1: 6" in text
    assert "requests a prefill step served: 2: 3 steps, 3: 3 steps" in text
    assert "burst sizes: 5: 3" in text
    assert report([]).startswith("no request")
