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
    assert result["engines"] == {"ours": {"block_size": 16, "kv_pool_tokens": 96},
                                 "ours_bs32": {"block_size": 32, "kv_pool_tokens": 96}}
    row = result["ours"][0]
    assert row["ours_tok_per_s"] > 0 and row["ours_bs32_tok_per_s"] > 0
    assert {name: len(runs) for name, runs in row["runs_s"].items()} == {"ours": 2, "ours_bs32": 2}


def test_refuses_a_block_size_named_twice(capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--block-size", "16", "16"])
    assert exit_info.value.code == 2
    assert "--block-size" in capsys.readouterr().err
