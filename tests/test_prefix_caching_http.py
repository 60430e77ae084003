"""Prefix caching as clients and operators see it, on a live server (caching on by default)."""

import re
import uuid

import httpx
import pytest

pytestmark = pytest.mark.slow

# Long enough for several full KV blocks of the default size (128 tokens).
SYSTEM = " ".join(f"Rule {i}: answer briefly and politely." for i in range(60))


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_a_repeated_prompt_reports_cached_tokens_everywhere(live_server, model_name):
    with httpx.Client(base_url=live_server, timeout=120) as client:
        before = client.get("/metrics").text
        body = {"model": model_name, "prompt": SYSTEM + " First question?", "max_tokens": 2, "temperature": 0}
        first = client.post("/v1/completions", json=body).json()["usage"]
        body["prompt"] = SYSTEM + " Second question?"
        second = client.post("/v1/completions", json=body).json()["usage"]
        assert first["prompt_tokens_details"]["cached_tokens"] % 128 == 0
        cached = second["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 128 and cached % 128 == 0 and cached < second["prompt_tokens"]

        tgi = client.post("/generate", json={"inputs": SYSTEM + " Third question?",
                                             "parameters": {"max_new_tokens": 2, "details": True}}).json()
        assert tgi["details"]["cached_tokens"] == cached

        after = client.get("/metrics").text
        queries = metric(after, "llm_prefix_cache_queries_tokens_total") - \
            metric(before, "llm_prefix_cache_queries_tokens_total")
        hits = metric(after, "llm_prefix_cache_hits_tokens_total") - metric(before, "llm_prefix_cache_hits_tokens_total")
        assert queries >= first["prompt_tokens"] + second["prompt_tokens"]
        assert hits >= 2 * cached
        assert 0 < metric(after, "llm_kv_cache_cached_ratio") <= 1
        # the prompts' shared start was encoded once: the later two took its ids from the first
        chars = metric(after, "llm_prompt_chars_total") - metric(before, "llm_prompt_chars_total")
        reused = metric(after, "llm_prompt_chars_reused_total") - metric(before, "llm_prompt_chars_reused_total")
        assert chars >= 3 * len(SYSTEM) and 2 * (len(SYSTEM) - 600) < reused < 2 * len(SYSTEM)


def test_a_cache_salt_shares_the_cache_only_with_the_same_salt(live_server, model_name):
    text = f"{uuid.uuid4().hex} {SYSTEM} A question?"          # nothing of it cached yet

    def cached(client, **salt):
        r = client.post("/v1/completions", json={"model": model_name, "prompt": text, "max_tokens": 1,
                                                 "temperature": 0, **salt})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with httpx.Client(base_url=live_server, timeout=120) as client:
        before = client.get("/metrics").text
        assert cached(client, cache_salt="tenant-a") == 0
        hit = cached(client, cache_salt="tenant-a")
        assert hit >= 128
        assert cached(client, cache_salt="tenant-b") == 0
        chat = [{"role": "system", "content": text}, {"role": "user", "content": "Hi"}]
        for _ in range(2):
            r = client.post("/v1/chat/completions", json={"model": model_name, "messages": chat, "max_tokens": 1,
                                                          "cache_salt": "tenant-c"})
            assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
        # the salted prompts' text was encoded afresh each time, not after a kept start
        after = client.get("/metrics").text
        assert metric(after, "llm_prompt_chars_reused_total") == metric(before, "llm_prompt_chars_reused_total")
        assert cached(client) == 0
        assert cached(client) == hit

        empty = client.post("/v1/chat/completions", json={
            "model": model_name, "messages": [{"role": "user", "content": "Hi"}], "cache_salt": ""})
        assert empty.status_code == 422 and "cache_salt" in empty.text
        tgi = client.post("/generate", json={"inputs": "Hi", "parameters": {"cache_salt": "tenant-a"}})
        assert tgi.status_code == 422 and "cache_salt" in tgi.text
