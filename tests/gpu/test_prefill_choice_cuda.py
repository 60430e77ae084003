"""The engine with the measured prefill table forced to the split-KV kernel for every shape, against
the engine without a table (FlashAttention over key rows read from the cache): prefix caching and
chunked prefill, eager prefill steps (captured prefill graphs keep FlashAttention)."""

import json
import random

import pytest
import torch

import kernels
from kernels import prefill_choice
from models import load_model
from server.engine import Engine, EngineConfig, SamplingParams
from server.engine.model_runner import ModelRunner

from ..helpers import decode_continuation, run_all
from .test_engine_cuda import NEAR_TIE, after_a_cached_prefix, first_difference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def use_table(monkeypatch, path, forced: bool, layout="9/3/64"):
    """Points the engine at a table choosing the kernel for every shape of ``layout`` on this GPU
    (``forced``), or at no table; returns the list of flash_prefill calls made from then on."""
    if forced:
        entries = [dict(shape=layout, kv_dtype=dtype, batch=b, new=n, cached=c, path=prefill_choice.SPLIT_KV)
                   for dtype in ("bf16", "int8") for b in (1, 256) for n in (1, 1 << 14) for c in (1, 1 << 20)]
        path.write_text(json.dumps({"devices": {torch.cuda.get_device_name(): {"margin": 0.03, "entries": entries}}}))
    monkeypatch.setattr(prefill_choice, "TABLE_PATH", path)
    calls = []
    flash_prefill = kernels.flash_prefill
    monkeypatch.setattr(kernels, "flash_prefill", lambda *a, **kw: calls.append(a[0].shape) or flash_prefill(*a, **kw))
    return calls


@torch.inference_mode()
def chunked_after_a_cached_prefix(loaded, prompt, continuation, kv_cache_dtype, fused, chunk=48):
    """Logits of ``prompt``'s last position and of decode steps fed ``continuation``: its first full
    blocks served from an earlier sequence's cache, the rest prefilled in chunks of ``chunk``."""
    runner = ModelRunner(loaded, EngineConfig(max_batch=4, num_blocks=64, block_size=32, graph_buckets=(1,),
                                              fused_layers=fused, prefill_graph_buckets=(),
                                              max_prefill_tokens=256, kv_cache_dtype=kv_cache_dtype),
                         max_model_len=1024)
    blocks, seq = after_a_cached_prefix(runner, prompt, 150)
    while seq.length - seq.num_cached > chunk:
        runner.prefill([(seq, chunk)])
        seq.num_cached += chunk
    return decode_continuation(runner, blocks, seq, runner.prefill([(seq, seq.length - seq.num_cached)])[0],
                               continuation)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-layers", "transformers-layers"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_kernel_gives_flash_attentions_logits_after_cached_prefixes_and_chunks(tmp_path, monkeypatch,
                                                                                   kv_cache_dtype, fused):
    loaded = load_model("random:smollm2-135m", dtype="bfloat16", device="cuda")
    rng = random.Random()
    prompt = [rng.randrange(10, 40000) for _ in range(400)]
    continuation = [rng.randrange(10, 40000) for _ in range(8)]
    results = {}
    for forced in (False, True):
        calls = use_table(monkeypatch, tmp_path / f"table-{forced}.json", forced)
        results[forced] = chunked_after_a_cached_prefix(loaded, prompt, continuation, kv_cache_dtype, fused)
        # every layer of every chunk after the cached prefix: 400 - 224 = 176 tokens in chunks of 48
        assert len(calls) == (4 * loaded.model.config.num_hidden_layers if forced else 0)
    flash, ours = results[False], results[True]
    assert torch.isfinite(ours).all()
    assert (ours - flash).norm() / flash.norm() < 2e-2
    assert (ours.argmax(-1) == flash.argmax(-1)).float().mean() >= 0.75


def test_the_engines_greedy_tokens_with_the_kernel_are_flash_attentions(tmp_path, monkeypatch):
    """Requests sharing a prefix, served after a first one cached it, prefilled in chunks of 64
    tokens: the same greedy tokens (up to a near tie) and log-probabilities within bf16 error."""
    loaded = load_model("random:smollm2-135m", dtype="bfloat16", device="cuda")
    rng = random.Random()
    prefix = [rng.randrange(10, 40000) for _ in range(300)]
    prompts = [prefix + [rng.randrange(10, 40000) for _ in range(rng.randint(1, 150))] for _ in range(4)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=True)
    config = EngineConfig(max_batch=4, num_blocks=256, block_size=32, graph_buckets=(1, 2, 4),
                          prefill_graph_buckets=(), max_prefill_tokens=64, prefix_caching=True)
    runs = {}
    for forced in (False, True):
        calls = use_table(monkeypatch, tmp_path / f"table-{forced}.json", forced)
        engine = Engine(loaded, config)
        engine.start()
        try:
            logprobs = [[] for _ in prompts]
            first = run_all(engine, [(prompts[0], params, None, logprobs[0])])
            rest = run_all(engine, [(p, params, None, lp) for p, lp in zip(prompts[1:], logprobs[1:])])
        finally:
            engine.shutdown()
        runs[forced] = [(tokens, lp) for (tokens, _, _), lp in zip(first + rest, logprobs)]
        assert bool(calls) == forced
    for row, ((tokens, lps), (flash_tokens, flash_lps)) in enumerate(zip(runs[True], runs[False])):
        assert len(tokens) == len(flash_tokens) == 24
        at = first_difference(tokens, flash_tokens)
        end = len(tokens) if at is None else at
        assert max((abs(a - b) for a, b in zip(lps[:end], flash_lps[:end])), default=0.0) < 0.1, row
        if at is not None:
            assert abs(lps[at] - flash_lps[at]) < NEAR_TIE, \
                f"row {row} parted at token {at}: {tokens[at]} against {flash_tokens[at]}, not a near tie"
