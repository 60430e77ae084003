"""The per-shape choice between the split-KV prefill kernel and FlashAttention: the measured table's
lookup and its conservative rounding, the benchmark's table writing, and attention's two paths."""

import json
import types

import pytest
import torch

import kernels
from benchmarks import prefill_bench
from kernels import prefill_choice
from kernels.prefill_choice import FLASH, SPLIT_KV, PrefillChoice
from models.attention import AttentionBatch, prefill_attention
from server.engine.model_runner import ModelRunner

BATCHES, ROWS, CACHED = (1, 4, 16), (16, 128, 512), (2048, 8192, 32768)


def grid(path_of) -> PrefillChoice:
    return PrefillChoice({(b, n, c): path_of(b, n, c) for b in BATCHES for n in ROWS for c in CACHED})


def test_a_measured_case_gives_its_own_path():
    choice = grid(lambda b, n, c: SPLIT_KV if (b, n, c) == (4, 128, 8192) else FLASH)
    assert choice.path(4, 128, 8192) == SPLIT_KV
    assert choice.path(4, 128, 2048) == FLASH
    assert choice.path(1, 16, 32768) == FLASH


def test_between_measured_cases_every_corner_must_choose_the_kernel():
    everywhere = grid(lambda b, n, c: SPLIT_KV)
    assert everywhere.path(2, 100, 5000) == SPLIT_KV
    one_corner = grid(lambda b, n, c: FLASH if (b, n, c) == (16, 512, 32768) else SPLIT_KV)
    assert one_corner.path(8, 300, 20000) == FLASH             # a corner of its cell chose FlashAttention
    assert one_corner.path(2, 100, 5000) == SPLIT_KV           # a cell that does not touch it
    assert one_corner.path(16, 512, 20000) == FLASH            # on measured values along two axes, the third between
    assert one_corner.path(16, 512, 8192) == SPLIT_KV


def test_outside_the_measured_range_or_a_missing_corner_is_flash():
    everywhere = grid(lambda b, n, c: SPLIT_KV)
    for shape in [(32, 128, 8192), (4, 8, 8192), (4, 1024, 8192), (4, 128, 1024), (4, 128, 65536)]:
        assert everywhere.path(*shape) == FLASH, shape
    holes = PrefillChoice({k: p for k, p in everywhere.cases.items() if k != (16, 512, 32768)})
    assert holes.path(16, 512, 32768) == FLASH
    assert holes.path(10, 300, 20000) == FLASH
    assert holes.path(10, 300, 5000) == SPLIT_KV
    assert PrefillChoice().path(4, 128, 8192) == FLASH
    assert not PrefillChoice().ever_split_kv


def test_a_step_is_looked_up_by_its_mean_rows_per_sequence():
    choice = grid(lambda b, n, c: SPLIT_KV if n >= 128 else FLASH)
    assert choice.split_kv(4, 512, 8192)          # 128 rows a sequence
    assert choice.split_kv(4, 511, 8192)          # 127.75, rounded up
    assert not choice.split_kv(4, 500, 8192)      # 125: its cell's corners at 16 rows chose FlashAttention
    assert not choice.split_kv(0, 0, 8192)


def write(path, device, entries):
    path.write_text(json.dumps({"devices": {device: {"margin": 0.03, "entries": entries}}}))


def entry(shape="9/3/64", kv_dtype="bf16", batch=4, new=128, cached=8192, path=SPLIT_KV):
    return dict(shape=shape, kv_dtype=kv_dtype, batch=batch, new=new, cached=cached, path=path)


def test_choice_for_matches_device_layout_and_cache_dtype_exactly(tmp_path):
    table = tmp_path / "table.json"
    write(table, "GPU A", [entry(), entry(shape="32/8/128"), entry(kv_dtype="int8", path=FLASH)])
    bf16 = prefill_choice.choice_for("GPU A", 9, 3, 64, torch.bfloat16, table)
    assert bf16.cases == {(4, 128, 8192): SPLIT_KV} and bf16.ever_split_kv
    assert prefill_choice.choice_for("GPU A", 9, 3, 64, torch.int8, table).cases == {(4, 128, 8192): FLASH}
    assert not prefill_choice.choice_for("GPU B", 9, 3, 64, torch.bfloat16, table).cases
    assert not prefill_choice.choice_for("GPU A", 15, 5, 64, torch.bfloat16, table).cases
    assert not prefill_choice.choice_for("GPU A", 9, 3, 64, torch.float16, table).cases
    assert not prefill_choice.choice_for("GPU A", 9, 3, 64, torch.float32, table).cases
    assert not prefill_choice.choice_for("GPU A", 9, 3, 64, torch.bfloat16, tmp_path / "absent.json").cases


def test_the_repository_table_loads():
    table = prefill_choice.load_table()
    for device, measured in table["devices"].items():
        for e in measured["entries"]:
            assert e["path"] in (SPLIT_KV, FLASH), (device, e)


def bench_row(ours, flash, engine, cudnn, batch=4, new=128, cached=8192, **extra):
    return dict(shape="9/3/64", batch=batch, new=new, cached=cached, kv_mb=1.0, splits=4, max_diff_vs_engine=0.0,
                ours_us=ours, engine_us=engine, flash_us=flash, cudnn_us=cudnn, cudnn_heads="gqa", **extra)


def test_the_kernel_wins_only_by_more_than_the_margin_over_the_best_peer():
    rows = [bench_row(95.0, 100.0, 150.0, 120.0, batch=1),          # 5 % under FA: ours
            bench_row(98.0, 100.0, 150.0, 120.0, batch=4),          # 2 % under FA: FlashAttention
            bench_row(95.0, 140.0, 150.0, 97.0, batch=16),          # 2 % under cuDNN: FlashAttention
            bench_row(None, 100.0, 150.0, 120.0, new=16),           # ours failed
            bench_row(50.0, None, None, None, new=512)]             # no peer measured
    entries = prefill_choice.entries_from_results(rows)
    assert [e["path"] for e in entries] == [SPLIT_KV, FLASH, FLASH, FLASH, FLASH]
    assert [e["best_peer"] for e in entries] == ["flash", "flash", "cudnn", "flash", None]
    assert entries[0]["best_peer_us"] == 100.0
    int8 = prefill_choice.entries_from_results([bench_row(95.0, 90.0, 150.0, 120.0, ours_int8_us=100.0,
                                                          engine_int8_us=160.0)])
    assert [(e["kv_dtype"], e["path"], e["best_peer"]) for e in int8] == [("bf16", FLASH, "flash"),
                                                                            ("int8", SPLIT_KV, "engine")]


def test_bench_write_table_adds_this_gpus_cases(tmp_path, monkeypatch):
    table = tmp_path / "prefill_table.json"
    write(table, "Other GPU", [entry()])
    rows = [bench_row(50.0, 100.0, 150.0, 120.0, batch=b, new=n, cached=c) for b in (1, 16) for n in (16, 512)
            for c in (2048, 32768)]
    rows[0]["ours_us"] = 99.0                                       # (1, 16, 2048): FlashAttention
    monkeypatch.setattr(prefill_bench, "run", lambda args: rows)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    prefill_bench.main(["--write-table", str(table)])
    written = json.loads(table.read_text())
    assert written["devices"]["Other GPU"]["entries"] == [entry()]
    choice = prefill_choice.choice_for("Fake GPU", 9, 3, 64, torch.bfloat16, table)
    assert len(choice.cases) == 8
    assert choice.path(1, 16, 2048) == FLASH
    assert choice.path(16, 512, 32768) == SPLIT_KV
    assert choice.path(8, 100, 10000) == FLASH                      # its cell has the FLASH corner
    assert choice.path(8, 100, 2048) == FLASH
    assert choice.path(16, 512, 20000) == SPLIT_KV
    # a case measured again replaces its entry, the others stay
    rows[:] = [bench_row(50.0, 100.0, 150.0, 120.0, batch=1, new=16, cached=2048)]
    prefill_bench.main(["--write-table", str(table)])
    choice = prefill_choice.choice_for("Fake GPU", 9, 3, 64, torch.bfloat16, table)
    assert len(choice.cases) == 8 and choice.path(8, 100, 10000) == SPLIT_KV


def paged_case(gen, cached, new, num_kv=3, group=3, head_dim=64, block_size=16):
    """Float64 caches holding each sequence's cached and new keys/values, the new rows' q/k/v packed,
    and the batch's index tensors."""
    lens = [c + n for c, n in zip(cached, new)]
    k = torch.randn(len(lens), num_kv, max(lens), head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(k.shape, generator=gen, dtype=torch.float64)
    k_cache, v_cache, table = kernels.pack_paged(k, v, block_size, generator=gen)
    q = torch.randn(sum(new), num_kv * group, head_dim, generator=gen, dtype=torch.float64)
    new_k = torch.cat([k[i, :, c:c + n].transpose(0, 1) for i, (c, n) in enumerate(zip(cached, new))])
    new_v = torch.cat([v[i, :, c:c + n].transpose(0, 1) for i, (c, n) in enumerate(zip(cached, new))])
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    return q, new_k, new_v, k_cache, v_cache, table, starts, lens


@pytest.mark.parametrize("window", [None, 7])
def test_attention_runs_the_kernel_only_with_a_prefill_workspace(monkeypatch, window):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    cached, new = [40, 5, 0, 97], [9, 1, 12, 30]
    q, k, v, k_cache, v_cache, table, starts, lens = paged_case(gen, cached, new)
    present = AttentionBatch([(k_cache, v_cache)], torch.zeros(0), table, torch.tensor(lens, dtype=torch.int32),
                             is_decode=False, query_starts=starts, context_lens=cached, max_query_len=max(new))

    def refuse(*args, **kwargs):
        raise AssertionError("flash_prefill called without a prefill workspace")
    with monkeypatch.context() as m:
        m.setattr(kernels, "flash_prefill", refuse)
        expected = prefill_attention(q, k, v, 0.125, present, k_cache, v_cache, window=window)

    calls = []
    flash_prefill = kernels.flash_prefill
    monkeypatch.setattr(kernels, "flash_prefill", lambda *a, **kw: calls.append(kw) or flash_prefill(*a, **kw))
    workspace = kernels.PrefillWorkspace(sum(new), 9, 64, table.shape[1] * 16, "cpu", num_kv_heads=3,
                                         windows=[window])
    split = AttentionBatch([(k_cache, v_cache)], torch.zeros(0), table, torch.tensor(lens, dtype=torch.int32),
                           is_decode=False, query_starts=starts, context_lens=cached, max_query_len=max(new),
                           cu_query_starts=torch.tensor(starts, dtype=torch.int32), prefill_workspace=workspace)
    got = prefill_attention(q, k, v, 0.125, split, k_cache, v_cache, window=window)
    assert len(calls) == 1 and calls[0]["workspace"] is workspace and calls[0]["window"] == window
    assert (got - expected).abs().max() < 1e-10


def test_the_runner_takes_the_kernel_only_where_the_table_and_its_workspace_allow():
    everywhere = grid(lambda b, n, c: SPLIT_KV)
    runner = types.SimpleNamespace(prefill_workspace=types.SimpleNamespace(max_rows=4096), prefill_choice=everywhere,
                                   max_blocks_per_seq=2048)
    takes = ModelRunner.takes_split_kv
    assert takes(runner, 4, 512, 8192, 600)
    assert not takes(runner, 4, 512, 1000, 600)                     # below the measured cached range
    assert not takes(runner, 16, 8192, 8192, 600)                   # more rows than the workspace holds
    assert not takes(runner, 4, 512, 8192, 2049)                    # a block table past the workspace's reach
    runner.prefill_workspace = None
    assert not takes(runner, 4, 512, 8192, 600)
