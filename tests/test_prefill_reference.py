"""The pure-PyTorch split-KV prefill (``kernels.reference_prefill``) against a float64 oracle on fresh
random inputs, its planner and workspace, and its refusals."""

import math
import os

import pytest
import torch

import kernels
from kernels import constants, planner
from kernels.kv_quant import dequantize_rows, quantize_rows
from kernels.prefill import split_prefill
from kernels.workspace import PrefillWorkspace

SEED = int.from_bytes(os.urandom(4), "little")
H100_SMS = 132


@pytest.fixture
def gen(request):
    seed = (SEED + hash(request.node.name)) % 2**31
    request.node.user_properties.append(("seed", seed))
    return torch.Generator().manual_seed(seed)


def make_case(gen, new_rows, cached, num_kv, group, head_dim, block_size=16, dtype=torch.float32, int8=False):
    """Dense K/V ``[B, Hkv, M, D]`` (float32 values, or int8 codes' dequantised values), the paged
    caches holding them (shuffled blocks), q ``[T, Hq, D]`` and the call's index tensors."""
    lens = [c + n for c, n in zip(cached, new_rows)]
    batch, longest = len(lens), max(max(lens), 1)
    k = torch.randn(batch, num_kv, longest, head_dim, generator=gen)
    v = torch.randn(batch, num_kv, longest, head_dim, generator=gen)
    scales = None
    if int8:   # rows of magnitudes differing up to 1000x, as the GPU tests use
        mags = 10.0 ** (torch.rand(2, batch, num_kv, longest, 1, generator=gen) * 3 - 2)
        (kc, ks), (vc, vs) = quantize_rows(k * mags[0]), quantize_rows(v * mags[1])
        k, v = dequantize_rows(kc, ks), dequantize_rows(vc, vs)
        state = gen.get_state()
        k_cache, v_cache, table = kernels.pack_paged(kc, vc, block_size, generator=gen)
        gen.set_state(state)   # the same block order for the scales
        k_scale, v_scale, _ = kernels.pack_paged(ks.unsqueeze(-1), vs.unsqueeze(-1), block_size, generator=gen)
        scales = (k_scale.squeeze(-1).contiguous(), v_scale.squeeze(-1).contiguous())
    else:
        k_cache, v_cache, table = kernels.pack_paged(k.to(dtype), v.to(dtype), block_size, generator=gen)
        k, v = k.to(dtype).float(), v.to(dtype).float()
    q = torch.randn(sum(new_rows), num_kv * group, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(new_rows).cumsum(0).tolist()), dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, table=table, cu=cu, seq_lens=seq_lens,
                scales=scales)


def oracle(case, scale, window=None):
    """float64 softmax attention, per sequence: new row j of n sits at position seq_len - n + j and
    sees positions p <= its own (and > its own - window), written independently of the reference."""
    q, k, v, cu, lens = case["q"], case["k"], case["v"], case["cu"].tolist(), case["seq_lens"].tolist()
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, total in enumerate(lens):
        n = cu[b + 1] - cu[b]
        if n == 0:
            continue
        kk = k[b, :, :total].double().repeat_interleave(group, dim=0)     # [Hq, L, D]
        vv = v[b, :, :total].double().repeat_interleave(group, dim=0)
        qq = q[cu[b]:cu[b + 1]].double().transpose(0, 1)                 # [Hq, n, D]
        scores = qq @ kk.transpose(1, 2) * scale                          # [Hq, n, L]
        row = torch.arange(total - n, total).view(-1, 1)
        key = torch.arange(total).view(1, -1)
        allowed = key <= row
        if window is not None:
            allowed &= key > row - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[cu[b]:cu[b + 1]] = (torch.softmax(scores, dim=-1) @ vv).transpose(0, 1)
    return out


def run(case, num_splits, window=None, scale=None):
    ks, vs = case["scales"] or (None, None)
    return split_prefill(case["q"], case["k_cache"], case["v_cache"], case["table"], case["cu"], case["seq_lens"],
                         num_splits, scale=scale, window=window, k_scale=ks, v_scale=vs)


def max_err(out, ref):
    return (out.double() - ref).abs().max().item() if out.numel() else 0.0


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("num_splits", [1, 7, 1000])
def test_ragged_batch_matches_float64(head_dim, group, num_splits, gen):
    new_rows = [1, 17, 64] + torch.randint(1, 100, (2,), generator=gen).tolist()
    cached = [0, 900] + torch.randint(0, 1500, (3,), generator=gen).tolist()
    case = make_case(gen, new_rows, cached, 2, group, head_dim)
    out = run(case, num_splits)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype and torch.isfinite(out).all()
    assert max_err(out, oracle(case, head_dim ** -0.5)) <= 1e-5


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 200, 512])
@pytest.mark.parametrize("cached", [0, 1, 127, 3000])
def test_query_blocks_and_cached_lengths(n, cached, gen):
    case = make_case(gen, [n], [cached], 1, 3, 64, block_size=32)
    assert max_err(run(case, 5), oracle(case, 0.125)) <= 1e-5


@pytest.mark.parametrize("window", [1, 2, 37, 128, 1000, 100000])
@pytest.mark.parametrize("num_splits", [1, 4, 300])
def test_sliding_windows(window, num_splits, gen):
    """Windows shorter than the new rows, than the cache, and longer than everything."""
    case = make_case(gen, [1, 150, 40], [2000, 60, 0], 2, 3, 64)
    out = run(case, num_splits, window=window)
    assert max_err(out, oracle(case, 0.125, window)) <= 1e-5


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [None, 100])
def test_int8_caches(head_dim, window, gen):
    case = make_case(gen, [33, 1, 128], [700, 0, 1500], 2, 4, head_dim, int8=True)
    out = run(case, 6, window=window)
    # rows up to 10x larger than unit: float32's error grows with them
    assert max_err(out, oracle(case, head_dim ** -0.5, window)) <= 1e-5 * case["v"].abs().max().item()


def test_int8_scales_are_read(gen):
    """Doubling one sequence's V scales doubles its rows' output and no other's."""
    case = make_case(gen, [10, 20], [100, 50], 1, 2, 64, int8=True)
    before = run(case, 3)
    ks, vs = case["scales"]
    used = case["table"][0, :math.ceil(110 / 16)].long()
    vs[used] *= 2
    after = run(case, 3)
    assert torch.allclose(after[:10], 2 * before[:10], rtol=1e-5, atol=1e-6)
    assert torch.equal(after[10:], before[10:])


def test_split_counts_agree(gen):
    case = make_case(gen, [300, 5, 77], [4000, 2500, 0], 3, 3, 128)
    ref = oracle(case, 128 ** -0.5)
    outs = [run(case, s) for s in (1, 2, 3, 16, 64, 5000)]
    for out in outs:
        assert max_err(out, ref) <= 1e-5
        assert (out - outs[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype, gen):
    case = make_case(gen, [50, 3], [400, 90], 2, 3, 64, dtype=dtype)
    out = run(case, 4)
    assert out.dtype == dtype
    # float32 arithmetic over low-precision inputs: the output's own rounding dominates
    assert max_err(out, oracle(case, 0.125)) <= 2 * torch.finfo(dtype).eps


def test_sequences_without_new_rows_and_a_first_token(gen):
    case = make_case(gen, [0, 1, 0, 9, 0], [50, 0, 0, 3, 7], 1, 2, 64)
    out = run(case, 3)
    assert out.shape[0] == 10
    assert max_err(out, oracle(case, 0.125)) <= 1e-5


def test_explicit_scale(gen):
    case = make_case(gen, [20], [30], 1, 1, 64)
    assert max_err(run(case, 2, scale=0.3), oracle(case, 0.3)) <= 1e-5


def test_flash_prefill_on_the_cpu_is_the_reference(gen):
    case = make_case(gen, [12, 40], [500, 20], 2, 3, 64)
    ws = PrefillWorkspace(64, 6, 64, case["table"].shape[1] * 16, "cpu", num_kv_heads=2, windows=(30,))
    for window in (None, 30):
        out = kernels.flash_prefill(case["q"], case["k_cache"], case["v_cache"], case["table"], case["cu"],
                                    case["seq_lens"], window=window, workspace=ws)
        assert max_err(out, oracle(case, 0.125, window)) <= 1e-5
        plain = kernels.flash_prefill(case["q"], case["k_cache"], case["v_cache"], case["table"], case["cu"],
                                      case["seq_lens"], window=window)
        assert max_err(plain, oracle(case, 0.125, window)) <= 1e-5


# -- the planner ------------------------------------------------------------------------------

def test_prefill_plans_fill_one_wave_within_the_caps():
    for rows in (1, 16, 64, 128, 512, 2048, 8192):
        for batch in (1, 4, 16):
            for num_q, num_kv in ((9, 3), (32, 8), (8, 1)):
                for max_len in (256, 2048, 32768, 131072):
                    plan = planner.prefill_plan(rows, batch, num_q, num_kv, H100_SMS, max_len)
                    group = num_q // num_kv
                    work = num_kv * max(min(batch, rows), math.ceil(rows * group / constants.PREFILL_ROWS))
                    assert 1 <= plan.num_splits <= planner.PREFILL_MAX_SPLITS
                    assert plan.num_splits <= planner.max_splits_for(max_len)
                    assert not plan.three_per_sm
                    if plan.num_splits > 1:
                        assert work * plan.num_splits <= constants.BLOCKS_PER_SM * H100_SMS


def test_prefill_plans_split_the_engines_collapse():
    """One request of 128 new rows over 2048 cached (issue 45: FlashAttention ran 9 blocks) and one
    short block over a long cache split; 16 x 512 rows fill the GPU with row tiles alone."""
    assert planner.prefill_plan(128, 1, 9, 3, H100_SMS, 2176).num_splits >= 8
    assert planner.prefill_plan(16, 1, 9, 3, H100_SMS, 32768).num_splits >= 32
    assert planner.prefill_plan(16 * 512, 16, 32, 8, H100_SMS, 32768).num_splits == 1


def test_prefill_plans_fall_as_rows_grow_and_windows_cap_them():
    for num_q, num_kv in ((9, 3), (32, 8)):
        splits = [planner.prefill_plan(r, 1, num_q, num_kv, H100_SMS, 65536).num_splits for r in range(1, 3000)]
        assert all(a >= b for a, b in zip(splits, splits[1:]))
        windowed = planner.prefill_plan(1, 1, num_q, num_kv, H100_SMS, 65536, window=256).num_splits
        assert windowed <= planner.max_splits_for(256 + constants.PREFILL_ROWS) < splits[0]


@pytest.mark.parametrize("num_q,num_kv", [(9, 3), (32, 8), (8, 1), (24, 1)])
def test_row_tile_bound_covers_every_ragged_batch(num_q, num_kv, gen):
    group = num_q // num_kv
    for _ in range(200):
        batch = int(torch.randint(1, 20, (1,), generator=gen))
        rows = torch.randint(0, 600, (batch,), generator=gen).tolist()
        total = max(sum(rows), 1)
        tiles = sum(math.ceil(n * group / constants.PREFILL_ROWS) for n in rows)
        assert tiles <= planner.prefill_row_tiles(total, batch, num_q, num_kv)


def test_prefill_plan_refuses_bad_sizes():
    with pytest.raises(ValueError, match="num_rows 0"):
        planner.prefill_plan(0, 1, 9, 3, H100_SMS, 100)
    with pytest.raises(ValueError, match="num_q_heads 9 must be a multiple of num_kv_heads 2"):
        planner.prefill_plan(1, 1, 9, 2, H100_SMS, 100)


# -- the workspace ---------------------------------------------------------------------------

def test_workspace_holds_every_plan(monkeypatch):
    monkeypatch.setattr("kernels.workspace.device_sm_count", lambda device: H100_SMS)
    ws = PrefillWorkspace(4096, 9, 64, 32768, "cpu", num_kv_heads=3, windows=(512,))
    need = max(rows * ws.plan(rows, batch, w).num_splits for rows in range(1, 4097) for batch in (1, 2, 16)
               for w in (None, 512) if ws.plan(rows, batch, w).num_splits > 1)
    assert ws.capacity_rows >= need
    assert ws.partial_out.shape == (ws.capacity_rows, 9, 64) and ws.partial_lse.shape == (ws.capacity_rows, 9)
    assert ws.capacity_rows * 9 * 64 * 4 < 64 * 2**20       # small: one wave's partials


def test_workspace_refuses_calls_it_was_not_planned_for():
    ws = PrefillWorkspace(100, 6, 64, 1024, "cpu", num_kv_heads=2, windows=(64,))
    ok = dict(num_rows=10, batch=2, num_q_heads=6, num_kv_heads=2, head_dim=64, max_blocks=64, block_size=16,
              device="cpu")
    ws.check_call(**ok)
    for change, message in (({"num_q_heads": 8}, "num_q_heads 6, this call has num_q_heads 8"),
                            ({"num_kv_heads": 3}, "num_kv_heads 2, this call has num_kv_heads 3"),
                            ({"head_dim": 128}, "head_dim 64, this call has head_dim 128"),
                            ({"num_rows": 101}, "up to 100 new tokens, this call has 101"),
                            ({"max_blocks": 65}, "up to 1024 tokens, this call's block table reaches 1040"),
                            ({"window": 32}, r"windows \[64\].*this call has window 32")):
        with pytest.raises(ValueError, match=message):
            ws.check_call(**{**ok, **change})
    ws.check_call(**ok, window=64)
    ws.check_call(**ok, window=5000)     # at least max_seq_len: global


# -- refusals -------------------------------------------------------------------------------

def test_refusals_name_both_values(gen):
    case = make_case(gen, [4, 6], [10, 20], 2, 2, 64)
    q, kc, vc, table, cu, lens = (case[k] for k in ("q", "k_cache", "v_cache", "table", "cu", "seq_lens"))

    def call(**change):
        args = dict(q=q, k_cache=kc, v_cache=vc, block_table=table, cu_query_starts=cu, seq_lens=lens)
        args.update(change)
        return kernels.reference_prefill(**args)

    cases = [
        (dict(q=q[:, :3]), "num_q_heads 3 must be a multiple of num_kv_heads 2"),
        (dict(q=q[..., :32]), "cache head_dim 64 != q head_dim 32"),
        (dict(q=q[0]), r"q must be \[total_new_rows, Hq, D\], got shape \(4, 64\)"),
        (dict(v_cache=vc[:-1]), "of one shape"),
        (dict(k_cache=kc.double(), v_cache=vc.double()), "the caches are torch.float64 but q is torch.float32"),
        (dict(cu_query_starts=cu[:-1]), r"cu_query_starts must be int32 \[B \+ 1 = 3\], got torch.int32 \(2,\)"),
        (dict(cu_query_starts=cu.long()), "cu_query_starts must be int32 .* got torch.int64"),
        (dict(seq_lens=lens[:1]), r"seq_lens must be int32 \[B=2\] .* got torch.int32 \(1,\)"),
        (dict(block_table=table.long()), "block_table must be int32"),
        (dict(cu_query_starts=torch.tensor([0, 4, 9], dtype=torch.int32)), "from 0 to q's 10 rows, got 0..9"),
        (dict(cu_query_starts=torch.tensor([0, 7, 10], dtype=torch.int32), seq_lens=torch.tensor([5, 26],
                                                                                                   dtype=torch.int32)),
         "sequence 0 has 7 new rows but seq_len 5"),
        (dict(seq_lens=torch.tensor([14, 10**6], dtype=torch.int32)), "seq_len 1000000 but the block table reaches"),
        (dict(k_scale=torch.zeros(kc.shape[:3], dtype=torch.float16)), "for int8 caches only"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**change)
    with pytest.raises(ValueError, match="window must be a positive int or None, got 0"):
        call(window=0)
    with pytest.raises(ValueError, match="int8 caches need k_scale and v_scale"):
        call(k_cache=kc.to(torch.int8), v_cache=vc.to(torch.int8))
