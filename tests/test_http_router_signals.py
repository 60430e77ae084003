"""What routers read of a replica: the gauges under vLLM's names (the Gateway API Inference
Extension's model-server protocol) and the SGLang Model Gateway's /server_info and /model_info."""

import concurrent.futures
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

NUM_BLOCKS, BLOCK_SIZE = 96, 16
# One sequence decodes at a time, so a second request waits: both gauges are non-zero at once.
ARGS = ("--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-batch", "1")


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(*ARGS)


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def only(found: dict, name: str):
    assert name in found, f"{name} missing from /metrics"
    assert len(found[name]) == 1, found[name]
    return found[name][0]


def test_vllm_gauges_match_the_engine(server):
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "one two three four five six seven eight nine ten eleven twelve",
            "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=300)
                   for _ in range(2)]
        deadline = time.monotonic() + 60
        while True:
            found = samples(httpx.get(server.url + "/metrics", timeout=10).text)
            running = only(found, "vllm:num_requests_running").value
            if running == 1 and only(found, "vllm:num_requests_waiting").value == 1:
                break
            assert time.monotonic() < deadline, "never saw one request running and one waiting"
            time.sleep(0.02)
        for f in futures:
            assert f.result().status_code == 200

    for ours, theirs in (("llm_num_requests_running", "vllm:num_requests_running"),
                         ("llm_num_requests_waiting", "vllm:num_requests_waiting"),
                         ("llm_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc")):
        sample = only(found, theirs)
        assert sample.labels == {"model_name": model}
        assert sample.value == only(found, ours).value, (theirs, ours)
    used = only(found, "llm_kv_cache_blocks_used").value
    assert used >= 1       # the running request holds its prompt's and output's blocks
    assert only(found, "vllm:kv_cache_usage_perc").value == pytest.approx(used / NUM_BLOCKS)

    config = only(found, "vllm:cache_config_info")
    assert config.value == 1
    assert config.labels == {"block_size": str(BLOCK_SIZE), "num_gpu_blocks": str(NUM_BLOCKS)}
    lora = only(found, "vllm:lora_requests_info")
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert 0 < lora.value <= time.time()

    idle = samples(httpx.get(server.url + "/metrics", timeout=10).text)
    assert only(idle, "vllm:num_requests_running").value == 0
    assert only(idle, "vllm:num_requests_waiting").value == 0
    assert only(idle, "vllm:kv_cache_usage_perc").value == 0


def test_server_info_names_the_served_model(server):
    models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    info = httpx.get(server.url + "/server_info", timeout=10)
    assert info.status_code == 200
    body = info.json()
    assert body["served_model_name"] == models[0]["id"]
    assert body["page_size"] == BLOCK_SIZE
    assert body["max_total_tokens"] == NUM_BLOCKS * BLOCK_SIZE
    assert body["context_length"] == models[0]["max_model_len"]
    # A path here would make the gateway try to load a tokenizer from it.
    assert "model_path" not in body and "tokenizer_path" not in body
    model_info = httpx.get(server.url + "/model_info", timeout=10).json()
    assert model_info == {"served_model_name": models[0]["id"], "is_generation": True}
