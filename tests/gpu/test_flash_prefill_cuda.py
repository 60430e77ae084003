"""The CUDA split-KV prefill (``kernels.flash_prefill``) against a float64 oracle (GPU only).

Criterion (as for the decode kernel, test_flash_decode_cuda.py): the kernel's max error against
float64 attention is at most twice that of plain PyTorch attention computed in q's precision over
the same inputs; never NaN. Inputs are fresh random each run (the seed is in the test's user
properties); cache rows past each sequence's end and unused blocks hold NaN (int8: random codes and
NaN scales), and the output and workspace are poisoned with NaN before each call. The oracle is the
repository's split reference (``kernels.prefill.split_prefill``, itself checked against an
independent float64 softmax in tests/test_prefill_reference.py) in float64 with one split.
"""

import pytest
import torch

import kernels
from kernels import ops, planner
from kernels.paging import DEFAULT_BLOCK_SIZE
from kernels.prefill import split_prefill
from kernels.workspace import PrefillWorkspace

from . import test_flash_decode_cuda
from .test_flash_decode_cuda import DEVICE, assert_within_twice_plain, capture, make_paged, poison
from .test_kv_int8_cuda import int8_paged

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
fresh_seed = test_flash_decode_cuda.fresh_seed   # the decode tests' autouse seed fixture, here too


def index_tensors(new_rows):
    cu = torch.tensor([0] + torch.tensor(new_rows).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return cu


def oracle(q, k_cache, v_cache, table, cu, seq_lens, scale, window=None):
    k64, v64 = (c.double().nan_to_num(0.0) for c in (k_cache, v_cache))
    return split_prefill(q.double(), k64, v64, table, cu, seq_lens, 1, scale=scale, window=window)


def plain_low_precision(q, k_cache, v_cache, table, cu, seq_lens, scale, window=None):
    """Plain PyTorch attention in q's dtype per sequence (scores, softmax and P V all low precision)."""
    out = torch.zeros_like(q)
    starts, lens = cu.tolist(), seq_lens.tolist()
    group = q.shape[1] // k_cache.shape[1]
    for b, total in enumerate(lens):
        n = starts[b + 1] - starts[b]
        if n == 0:
            continue
        k = kernels.reference.gather_dense(k_cache.nan_to_num(0.0), table[b:b + 1], total)[0].to(q.dtype)
        v = kernels.reference.gather_dense(v_cache.nan_to_num(0.0), table[b:b + 1], total)[0].to(q.dtype)
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        qq = q[starts[b]:starts[b + 1]].transpose(0, 1)
        scores = (qq @ k.transpose(1, 2)) * scale
        row = torch.arange(total - n, total, device=DEVICE).view(-1, 1)
        key = torch.arange(total, device=DEVICE).view(1, -1)
        allowed = key <= row
        if window is not None:
            allowed &= key > row - window
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).to(q.dtype)
        out[starts[b]:starts[b + 1]] = (probs @ v).transpose(0, 1)
    return out


def assert_accurate(outs, q, k_ref, v_ref, table, cu, seq_lens, scale, context="", window=None):
    """Finite, and the error against float64 at most twice plain attention's in q's dtype
    (``k_ref/v_ref``: the caches as values, the dequantised ones for int8)."""
    ref = oracle(q, k_ref, v_ref, table, cu, seq_lens, scale, window)
    plain = plain_low_precision(q, k_ref.to(q.dtype), v_ref.to(q.dtype), table, cu, seq_lens, scale, window)
    assert_within_twice_plain(outs, ref, plain, context)


def check(new_rows, cached, num_q, num_kv, head_dim, block_size=DEFAULT_BLOCK_SIZE, dtype=torch.bfloat16, window=None,
          int8=False, seed=None, workspace=None):
    lengths = [c + n for c, n in zip(cached, new_rows)]
    if int8:
        k_cache, v_cache, ks, vs, k_ref, v_ref, table, seq_lens = int8_paged(lengths, num_kv, head_dim, block_size)
    else:
        k_cache, v_cache, table, seq_lens = make_paged(lengths, num_kv, head_dim, block_size, dtype)
        k_ref, v_ref, ks, vs = k_cache, v_cache, None, None
    cu = index_tensors(new_rows)
    q = torch.randn(sum(new_rows), num_q, head_dim, device=DEVICE, dtype=dtype)
    scale = head_dim ** -0.5
    if workspace is None:
        workspace = PrefillWorkspace(q.shape[0], num_q, head_dim, table.shape[1] * block_size, DEVICE,
                                     num_kv_heads=num_kv, windows=(window,))
    poison(workspace, q.shape, dtype)
    out = kernels.flash_prefill(q, k_cache, v_cache, table, cu, seq_lens, scale=scale, window=window, k_scale=ks,
                                v_scale=vs, workspace=workspace)
    assert out.shape == q.shape and out.dtype == dtype
    plan = workspace.plan(q.shape[0], len(new_rows), window)
    assert_accurate([out], q, k_ref, v_ref, table, cu, seq_lens, scale,
                    f"seed={seed} rows={new_rows[:8]} cached={cached[:8]} window={window} int8={int8} plan={plan}",
                    window)
    return out


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ragged_batch_matches_float64(dtype, head_dim, group, block_size, fresh_seed):
    new_rows = [1, 17, 64, 130] + torch.randint(1, 200, (2,)).tolist()
    cached = [0, 300, block_size - 1, 2500] + torch.randint(0, 3000, (2,)).tolist()
    check(new_rows, cached, 2 * group, 2, head_dim, block_size, dtype, seed=fresh_seed)


@pytest.mark.parametrize("n", [1, 15, 16, 21, 64, 65, 200, 512])
@pytest.mark.parametrize("cached", [0, 1, 4096])
def test_query_blocks(n, cached, fresh_seed):
    check([n], [cached], 9, 3, 64, seed=fresh_seed)
    check([n, 3], [cached, 50], 32, 8, 128, dtype=torch.float16, seed=fresh_seed)


@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128), (4, 1, 256)], ids=lambda s: "/".join(map(str, s)))
def test_long_cached_prefixes(shape, fresh_seed):
    num_q, num_kv, dim = shape
    check([16, 128, 1], [131072 - 16, 65536, 77777], num_q, num_kv, dim, seed=fresh_seed)


@pytest.mark.parametrize("window", [1, 64, 500, 4096])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128), (4, 1, 256)], ids=lambda s: "/".join(map(str, s)))
def test_sliding_windows(shape, window, fresh_seed):
    num_q, num_kv, dim = shape
    check([1, 300, 40, 512], [5000, 100, 0, 9000], num_q, num_kv, dim, 16, window=window, seed=fresh_seed)


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_caches(dtype, head_dim, window, fresh_seed):
    check([1, 64, 200], [3000, 0, 700], 8, 2, head_dim, 32, dtype, window=window, int8=True, seed=fresh_seed)


@pytest.mark.parametrize("batch", [33, 100])
def test_batches_past_one_warp_of_sequences(batch, fresh_seed):
    """The kernel finds each block's sequence 32 sequences at a time; some have no new rows."""
    new_rows = torch.randint(0, 40, (batch,)).tolist()
    new_rows[-1] = max(new_rows[-1], 1)
    cached = torch.randint(0, 2000, (batch,)).tolist()
    check(new_rows, cached, 9, 3, 64, seed=fresh_seed)


def test_sequences_without_new_rows_and_first_tokens(fresh_seed):
    check([0, 1, 0, 9, 0, 64], [50, 0, 0, 3, 7, 0], 6, 2, 128, 16, seed=fresh_seed)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16, 17, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_split_count(head_dim, num_splits, fresh_seed):
    """The op at split counts the planner may not pick (merge kernel in one trip, in two, none)."""
    new_rows, cached = [3, 100, 64], [20000, 4000, 0]
    lengths = [c + n for c, n in zip(cached, new_rows)]
    k_cache, v_cache, table, seq_lens = make_paged(lengths, 2, head_dim, 64, torch.bfloat16)
    cu = index_tensors(new_rows)
    q = torch.randn(sum(new_rows), 6, head_dim, device=DEVICE, dtype=torch.bfloat16)
    partial_out = torch.full((q.shape[0] * num_splits, 6, head_dim), float("nan"), device=DEVICE)
    partial_lse = torch.full((q.shape[0] * num_splits, 6), float("nan"), device=DEVICE)
    tiles = planner.prefill_row_tiles(q.shape[0], 3, 6, 2)
    ops.load(DEVICE)
    out = torch.ops.flashdecode.flash_prefill(q, k_cache, v_cache, table, cu, seq_lens, head_dim ** -0.5, num_splits,
                                              tiles, partial_out, partial_lse, 0, None, None)
    assert_accurate([out], q, k_cache, v_cache, table, cu, seq_lens, head_dim ** -0.5, f"splits={num_splits}")


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128)], ids=lambda s: "/".join(map(str, s)))
def test_graph_replay_with_changed_lengths(shape, int8, fresh_seed):
    """write_kv of the new rows then flash_prefill, captured once (fixed T and B, as the engine
    captures), replayed over new lengths, split points and contents: each replay equals an eager
    call on the same state and meets the criterion."""
    num_q, num_kv, dim = shape
    bs, batch, rows, max_len = 16, 4, 96, 6000
    lengths = [max_len] * batch
    if int8:
        k_cache, v_cache, ks, vs, _, _, table, seq_lens = int8_paged(lengths, num_kv, dim, bs,
                                                                     table_blocks=max_len // bs)
    else:
        k_cache, v_cache, table, seq_lens = make_paged(lengths, num_kv, dim, bs, torch.bfloat16,
                                                       table_blocks=max_len // bs)
        ks = vs = None
    ws = PrefillWorkspace(rows, num_q, dim, max_len, DEVICE, num_kv_heads=num_kv)
    q = torch.randn(rows, num_q, dim, device=DEVICE, dtype=torch.bfloat16)
    key = torch.randn(rows, num_kv, dim, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
    slots = torch.zeros(rows, dtype=torch.int64, device=DEVICE)

    def step():
        kernels.write_kv(k_cache, v_cache, key, value, slots, ks, vs)
        return ops.flash_prefill_cuda(q, k_cache, v_cache, table, cu, seq_lens, workspace=ws, k_scale=ks, v_scale=vs)

    def new_inputs():
        cuts = sorted(torch.randint(0, rows + 1, (batch - 1,)).tolist())
        new = [b - a for a, b in zip([0] + cuts, cuts + [rows])]
        lens = [int(torch.randint(n, max_len + 1, (1,))) if n else int(torch.randint(1, max_len, (1,))) for n in new]
        cu.copy_(index_tensors(new))
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        pos = torch.cat([torch.arange(total - n, total) for n, total in zip(new, lens)]).to(DEVICE)
        seq = torch.repeat_interleave(torch.arange(batch, device=DEVICE), torch.tensor(new, device=DEVICE))
        slots.copy_(table[seq, pos // bs].long() * bs + pos % bs)
        for t in (q, key, value):
            t.copy_(torch.randn_like(t))

    new_inputs()
    torch.cuda.synchronize()
    graph, static_out = capture(step)
    for _ in range(3):
        new_inputs()
        caches = [c for c in (k_cache, v_cache, ks, vs) if c is not None]
        before = [c.clone() for c in caches]
        static_out.fill_(float("nan"))
        ws.partial_out.fill_(float("nan"))
        graph.replay()
        replayed = static_out.clone()
        after = [c.clone() for c in caches]
        for c, saved in zip(caches, before):
            c.copy_(saved)
        eager = step()
        assert torch.equal(replayed, eager)
        if int8:
            k_ref = kernels.kv_quant.dequantize_rows(after[0], after[2])
            v_ref = kernels.kv_quant.dequantize_rows(after[1], after[3])
        else:
            k_ref, v_ref = after
        assert_accurate([replayed], q, k_ref, v_ref, table, cu, seq_lens, dim ** -0.5, f"int8={int8}")


def test_refusals_name_both_values():
    k_cache, v_cache, table, seq_lens = make_paged([10, 20], 2, 64, 16, torch.bfloat16)
    cu = index_tensors([4, 6])
    q = torch.randn(10, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        kernels.flash_prefill(q.float(), k_cache.float(), v_cache.float(), table, cu, seq_lens)
    with pytest.raises(ValueError, match="the caches are torch.float16 but q is torch.bfloat16"):
        kernels.flash_prefill(q, k_cache.half(), v_cache.half(), table, cu, seq_lens)
    with pytest.raises(ValueError, match=r"cu_query_starts must be int32 \[B \+ 1 = 3\]"):
        kernels.flash_prefill(q, k_cache, v_cache, table, cu[:2], seq_lens)
    ws = PrefillWorkspace(8, 4, 64, 1024, DEVICE, num_kv_heads=2)
    with pytest.raises(ValueError, match="up to 8 new tokens, this call has 10"):
        kernels.flash_prefill(q, k_cache, v_cache, table, cu, seq_lens, workspace=ws)
    ws = PrefillWorkspace(64, 8, 64, 1024, DEVICE, num_kv_heads=2)
    with pytest.raises(ValueError, match="num_q_heads 8, this call has num_q_heads 4"):
        kernels.flash_prefill(q, k_cache, v_cache, table, cu, seq_lens, workspace=ws)
    with pytest.raises(ValueError, match="takes a PrefillWorkspace, got Workspace"):
        kernels.flash_prefill(q, k_cache, v_cache, table, cu, seq_lens,
                              workspace=kernels.Workspace(2, 4, 64, 1024, DEVICE, num_kv_heads=2))
    # the op itself: too few row tiles would leave output rows unwritten (bound: ceil(10 * 2 / 64) + 2 = 3)
    ops.load(DEVICE)
    partial_out, partial_lse = torch.empty(0, device=DEVICE), torch.empty(0, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"row_tiles must be in 3\.\.65535"):
        torch.ops.flashdecode.flash_prefill(q, k_cache, v_cache, table, cu, seq_lens, 0.125, 1, 2, partial_out,
                                            partial_lse, 0, None, None)
