"""The offline engine benchmark's command line, on the CPU with a tiny random model."""

import json

import pytest

from kernels import ops
from load_tests import engine_bench


def test_refuses_an_unknown_merge_mode(capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--merge-mode", "99"])
    assert exit_info.value.code == 2
    assert "--merge-mode" in capsys.readouterr().err


def test_merge_mode_sets_the_kernel_default_and_a_row_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "DEFAULT_MERGE", ops.DEFAULT_MERGE)  # restored after the test
    out = tmp_path / "bench.json"
    engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--batch", "2", "--prompt-len", "8",
                       "--new-tokens", "4", "--hf", "--repeats", "1", "--merge-mode", str(ops.MERGE_KERNEL_PDL),
                       "--out", str(out)])
    assert ops.DEFAULT_MERGE == ops.MERGE_KERNEL_PDL
    result = json.loads(out.read_text())
    assert result["merge_mode"] == ops.MERGE_KERNEL_PDL
    assert [r["batch"] for r in result["ours"]] == [2]
    assert result["ours"][0]["ours_tok_per_s"] > 0


def test_several_block_sizes_run_interleaved_with_pools_of_equal_tokens(tmp_path):
    out = tmp_path / "bench.json"
    engine_bench.main(["--model", "random:tiny", "--device", "cpu", "--batch", "2", "--prompt-len", "8",
                       "--new-tokens", "4", "--hf", "--repeats", "2", "--block-size", "16", "32",
                       "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["block_size"] == 16 and result["other_block_sizes"] == [32]
    row = result["ours"][0]
    assert row["ours_tok_per_s"] > 0 and row["ours_bs32_tok_per_s"] > 0
    assert {name: len(runs) for name, runs in row["runs_s"].items()} == {"ours": 2, "ours_bs32": 2}
    assert result["kv_pool_tokens"] == 96        # 2 x (8 + 4 + 32) tokens, in whole blocks of 16 (and of 32)
