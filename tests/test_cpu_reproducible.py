"""The same request with the same seed gives the same tokens on the quantised CPU path, whichever
thread mode its decode steps run in and however busy the host is (``models.cpu_threads``).

The cause of the differences once seen: in the one-thread mode a one-sequence decode step ran
its layers eagerly, in the all-threads mode compiled (``models.cpu_decode``), and the two round
differently (logits up to 0.5 apart); the chooser switches modes with the host's load. Thread
counts alone change nothing: the compiled and the eager layers each compute the same on one
thread as on two.
"""

import json
import subprocess
import sys

import httpx
import pytest
import torch

from models import load_model
from models.cpu_threads import ALL_THREADS, ONE_THREAD, ThreadChooser
from server.engine import Engine, EngineConfig, SamplingParams
from server.engine.model_runner import ModelRunner

from .helpers import chat_ids, run_all, runner_teacher_forced

pytestmark = pytest.mark.slow

PROMPT = "用三句话介绍一下长城的历史。"          # the report's Chinese prompt: many multi-byte tokens


@pytest.fixture(scope="module")
def loaded():
    return load_model("default", dtype="float32", device="cpu")


def pinned(step, mode: str | None) -> None:
    step.threads = ThreadChooser(step.threads.threads, pinned=mode)


def busy_processes(count: int = 2) -> list[subprocess.Popen]:
    """Processes spinning on the CPU, as a neighbour's busy job would."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(processes) -> None:
    for p in processes:
        p.kill()
        p.wait()


def test_a_decode_step_computes_the_same_in_either_thread_mode(loaded):
    runner = ModelRunner(loaded, EngineConfig(max_batch=2, num_blocks=64, block_size=16, cpu_weights="quantized"),
                         1024)
    step = runner.forward
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: there is no other mode")
    assert step.compiled, "the one-sequence decode step runs compiled layers here"
    prompt = chat_ids(loaded.tokenizer, PROMPT)
    continuation = list(range(1000, 1020))
    logits = {}
    for mode in (ALL_THREADS, ONE_THREAD):
        pinned(step, mode)
        logits[mode] = runner_teacher_forced(runner, prompt, continuation)
    assert torch.equal(logits[ALL_THREADS], logits[ONE_THREAD]), \
        (logits[ALL_THREADS] - logits[ONE_THREAD]).abs().amax(-1)


def sampled(engine: Engine, prompt: list[int]) -> list[list[int]]:
    """Seeds 1, 2 and 3 at temperature 1, 40 tokens each, one request at a time."""
    out = []
    for seed in (1, 2, 3):
        params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)
        (tokens, _, finish), = run_all(engine, [(prompt, params)])
        assert finish.reason == "length"
        out.append(tokens)
    return out


def test_the_same_seed_gives_the_same_tokens_in_each_thread_mode_and_beside_busy_processes(loaded):
    engine = Engine(loaded, EngineConfig(max_batch=4, num_blocks=64, block_size=16, cpu_weights="quantized",
                                         prefix_caching=False))
    engine.start()
    try:
        step = engine.core.runner.forward
        prompt = chat_ids(loaded.tokenizer, PROMPT)
        runs = {}
        for mode in (ALL_THREADS, ONE_THREAD):
            pinned(step, mode)
            runs[mode] = sampled(engine, prompt)
        step.threads = chooser = RecordingChooser(step.threads.threads)   # switching as it measures
        busy = busy_processes()
        try:
            runs["busy host"] = sampled(engine, prompt)
        finally:
            stop(busy)
    finally:
        engine.shutdown()
    assert runs[ALL_THREADS] == runs[ONE_THREAD] == runs["busy host"], runs
    assert len({tuple(t) for t in runs[ALL_THREADS]}) == 3, "the seeds sample differently"
    assert chooser.modes == {ALL_THREADS, ONE_THREAD}, "the busy run's steps ran in both modes"


class RecordingChooser(ThreadChooser):
    def __init__(self, threads: int):
        super().__init__(threads)
        self.modes: set[str] = set()

    def record(self, mode: str, batch: int, seconds: float) -> None:
        self.modes.add(mode)
        super().record(mode, batch, seconds)


def completion(url: str, seed: int, stream: bool, salt: str) -> str:
    """The text of a completions request (temperature 1, 40 tokens); its own ``cache_salt`` keeps
    the prefix cache out of the comparison."""
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 40, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "stream": stream, "cache_salt": salt}
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body["model"] = model
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[5:])["choices"]]
    return "".join(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the live server runs on the GPU here")
def test_the_same_seed_gives_the_same_text_streamed_or_not(live_server):
    """The report's repro: seeds 1-3, streamed and not, and twice not, over HTTP."""
    for seed in (1, 2, 3):
        texts = {(stream, i): completion(live_server, seed, stream, f"{seed}-{stream}-{i}")
                 for stream, i in ((False, 0), (True, 0), (False, 1))}
        assert len(set(texts.values())) == 1, texts
