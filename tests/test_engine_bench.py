"""The offline engine benchmark's command line, on the CPU with a tiny random model."""

import json

import pytest

from load_tests import engine_bench


def test_a_row_is_written(tmp_path):
    out = tmp_path / "bench.json"
    engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--batch", "2", "--prompt-len", "8",
                       "--new-tokens", "4", "--hf", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["ours"]] == [2]
    assert result["ours"][0]["ours_tok_per_s"] > 0


def test_several_block_sizes_run_interleaved_with_pools_of_equal_tokens(tmp_path, monkeypatch):
    calls = []
    run_ours = engine_bench.run_ours

    def recording(core, prompts, new_tokens):
        calls.append((core.runner.block_size, len(prompts)))
        return run_ours(core, prompts, new_tokens)

    monkeypatch.setattr(engine_bench, "run_ours", recording)
    out = tmp_path / "bench.json"
    engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--batch", "2", "--prompt-len", "8",
                       "--new-tokens", "4", "--hf", "--repeats", "2", "--block-size", "16", "32",
                       "--out", str(out)])
    # a one-prompt warm-up of each engine, then the timed runs taking turns
    assert calls == [(16, 1), (32, 1), (16, 2), (32, 2), (16, 2), (32, 2)]
    result = json.loads(out.read_text())
    # 2 x (8 + 4 + 32) = 88 tokens, in whole blocks of 16 and of 32: 96 each
    assert {name: (e["block_size"], e["kv_pool_tokens"]) for name, e in result["engines"].items()} == \
        {"ours": (16, 96), "ours_bs32": (32, 96)}
    row = result["ours"][0]
    assert row["ours_tok_per_s"] > 0 and row["ours_bs32_tok_per_s"] > 0
    assert {name: len(runs) for name, runs in row["runs_s"].items()} == {"ours": 2, "ours_bs32": 2}


def test_refuses_a_block_size_named_twice(capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--block-size", "16", "16"])
    assert exit_info.value.code == 2
    assert "--block-size" in capsys.readouterr().err


def test_shared_prefix_with_caching_on_and_off_and_new_prompts_every_round(tmp_path, monkeypatch):
    seen = []
    run_ours = engine_bench.run_ours

    def recording(core, prompts, new_tokens):
        seen.append((core.blocks.prefix_caching, prompts))
        return run_ours(core, prompts, new_tokens)

    monkeypatch.setattr(engine_bench, "run_ours", recording)
    out = tmp_path / "bench.json"
    engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--batch", "3", "--prompt-len", "8",
                       "--shared-prefix", "40", "--new-tokens", "4", "--hf", "--repeats", "2", "--block-size", "16",
                       "--prefix-caching", "on", "off", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["engines"]["ours"]["prefix_caching"] is True
    assert result["engines"]["ours_nocache"]["prefix_caching"] is False
    assert result["engines"]["ours"]["prefix_cache_hit_share"] > 0.4
    assert result["engines"]["ours_nocache"]["prefix_cache_hit_share"] == 0
    row = result["ours"][0]
    assert (row["prompt_len"], row["shared_prefix"]) == (48, 40) and row["ours_nocache_tok_per_s"] > 0
    timed = [prompts for _, prompts in seen[2:]]               # after one warm-up per engine
    assert [caching for caching, _ in seen] == [True, False] * 3
    prefix = timed[0][0][:40]
    assert all(len(p) == 48 and p[:40] == prefix for prompts in timed for p in prompts)
    assert timed[0] == timed[1] and timed[2] == timed[3]       # both engines get the round's prompts
    assert timed[0] != timed[2]                                # and every round new ones


def test_refuses_a_caching_setting_named_twice(capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--prefix-caching", "on", "on"])
    assert exit_info.value.code == 2
    assert "--prefix-caching" in capsys.readouterr().err


def test_the_architecture_benchmark_writes_a_row_per_preset_and_batch(tmp_path):
    from load_tests import arch_bench

    status = arch_bench.main(["--device", "cpu", "--presets", "qwen3-0.6b@1", "tiny", "--batch", "1", "2",
                              "--prompt-len", "8", "--new-tokens", "3", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "arch_bench.json").read_text())
    assert status == 0 and result["failed"] == {}
    assert [(r["preset"], r["batch"]) for r in result["rows"]] == [("qwen3-0.6b@1", 1), ("qwen3-0.6b@1", 2),
                                                                   ("tiny", 1), ("tiny", 2)]
    assert result["rows"][0]["fused_step"] == "FusedDecoder"
    for row in result["rows"]:
        assert all(row[f"{name}_tok_per_s"] > 0 for name in arch_bench.COLUMNS)
        assert {name: len(runs) for name, runs in row["runs_s"].items()} == dict.fromkeys(arch_bench.COLUMNS, 1)
    assert "| qwen3-0.6b@1 | 1 |" in (tmp_path / "arch_bench.md").read_text()


def test_kv_cache_dtypes_run_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--batch", "2", "--prompt-len", "8",
                       "--new-tokens", "4", "--hf", "--repeats", "1", "--kv-cache-dtype", "auto", "int8",
                       "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["engines"]) == {"ours", "ours_int8"}
    assert result["ours"][0]["ours_int8_tok_per_s"] > 0


def test_decode_step_timing_needs_cuda():
    with pytest.raises(SystemExit):
        engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--decode-step", "1:128"])


def test_closed_loop_keeps_the_streams_busy_and_fill_pool_leaves_every_block_cached(tmp_path, monkeypatch):
    filled = []
    fill_pool = engine_bench.fill_pool

    def recording_fill(core, vocab, seed):
        fill_pool(core, vocab, seed)
        filled.append((core.blocks.prefix_caching, core.blocks.num_cached_idle, core.blocks.num_blocks))

    admitted = []
    run_closed_loop = engine_bench.run_closed_loop

    def recording_loop(core, prompts, new_tokens, streams):
        add = core.add

        def add_counting(*args, **kwargs):
            admitted.append(len(core.scheduler.running) + len(core.scheduler.waiting))
            return add(*args, **kwargs)

        core.add = add_counting
        try:
            elapsed, firsts = run_closed_loop(core, prompts, new_tokens, streams)
            assert len(firsts) == len(prompts) and all(f > 0 for f in firsts)
            return elapsed, firsts
        finally:
            del core.add

    monkeypatch.setattr(engine_bench, "fill_pool", recording_fill)
    monkeypatch.setattr(engine_bench, "run_closed_loop", recording_loop)
    out = tmp_path / "bench.json"
    engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--batch", "2", "--prompt-len", "8",
                       "--new-tokens", "4", "--closed-loop", "3", "--repeats", "1", "--num-blocks", "40",
                       "--block-size", "16", "--prefix-caching", "on", "off", "--fill-pool", "--out", str(out)])
    # with caching every block is cached and idle after the fill; without, none is
    assert filled == [(True, 40, 40), (False, 0, 40)]
    # per engine: 2 streams of 3 requests, never more than 2 in the engine when one is added
    assert len(admitted) == 12 and max(admitted) <= 1
    row = json.loads(out.read_text())["ours"][0]
    assert row["requests"] == 6 and row["ours_tok_per_s"] > 0 and row["ours_nocache_tok_per_s"] > 0
    assert row["ours_ttft_ms"] > 0 and row["ours_nocache_ttft_ms"] > 0
