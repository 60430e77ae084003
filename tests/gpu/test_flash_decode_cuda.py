"""The CUDA flash-decoding op against a float64 oracle (GPU only).

Criterion (FlashAttention's): the kernel's max error against float64 attention is at most twice
that of plain PyTorch attention computed in the same low precision; never NaN. Inputs are fresh
random each run (the seed is printed on failure); cache rows past each sequence's end and unused
blocks hold NaN, and the output and workspace are poisoned with NaN before each call.
"""

import math
import os

import pytest
import torch

import kernels
from kernels import layer_ops, ops
from kernels.paging import DEFAULT_BLOCK_SIZE
from kernels.reference import gather_dense, reference_decode, reference_write_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SEED = int.from_bytes(os.urandom(4), "little")
DEVICE = torch.device("cuda")
BLOCK_SIZES = sorted({16, 32, DEFAULT_BLOCK_SIZE})


@pytest.fixture(autouse=True)
def fresh_seed(request):
    seed = (SEED + hash(request.node.name)) % 2**31
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


def make_paged(lengths, num_kv_heads, head_dim, block_size, dtype, spare_blocks=3):
    """A random paged cache whose rows past each sequence's end, and unused blocks, are NaN."""
    lengths = [int(n) for n in lengths]
    batch = len(lengths)
    per_seq = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(per_seq) + spare_blocks
    max_blocks = max(per_seq) + 2
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(shape, device=DEVICE, dtype=dtype)
    table = torch.full((batch, max_blocks), 2**30, dtype=torch.int32)   # past the end: never read
    order = torch.randperm(num_blocks).tolist()
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    used = 0
    for b, (n, blocks) in enumerate(zip(lengths, per_seq)):
        ids = order[used:used + blocks]
        used += blocks
        table[b, :blocks] = torch.tensor(ids, dtype=torch.int32)
        for i, block in enumerate(ids):
            valid[block, :min(block_size, n - i * block_size)] = True
    invalid = (~valid).to(DEVICE).view(num_blocks, 1, block_size, 1)
    k_cache.masked_fill_(invalid, float("nan"))
    v_cache.masked_fill_(invalid, float("nan"))
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, table.to(DEVICE), seq_lens


def oracle(q, k_cache, v_cache, table, seq_lens, scale):
    """float64 attention (the repo's reference with one split)."""
    k64, v64 = (c.double().nan_to_num(0.0) for c in (k_cache, v_cache))
    return reference_decode(q.double(), k64, v64, table, seq_lens, scale=scale, num_splits=1)


def plain_low_precision(q, k_cache, v_cache, table, seq_lens, scale):
    """Plain PyTorch attention in the input dtype (scores, softmax and P V all low precision)."""
    width = int(seq_lens.max())
    k = gather_dense(k_cache.nan_to_num(0.0), table, width)
    v = gather_dense(v_cache.nan_to_num(0.0), table, width)
    batch, num_q, dim = q.shape
    num_kv = k.shape[1]
    qg = q.view(batch, num_kv, num_q // num_kv, dim)
    scores = torch.einsum("bhgd,bhnd->bhgn", qg, k) * scale
    mask = torch.arange(width, device=q.device).view(1, 1, 1, width) >= seq_lens.view(batch, 1, 1, 1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1).to(q.dtype)
    return torch.einsum("bhgn,bhnd->bhgd", probs, v).reshape(batch, num_q, dim)


def assert_accurate(outs, q, k_cache, v_cache, table, seq_lens, scale, context=""):
    """The criterion of every test here, for outputs of the same inputs: finite, and their error
    against float64 attention at most twice plain low-precision attention's."""
    ref = oracle(q, k_cache, v_cache, table, seq_lens, scale)
    plain = plain_low_precision(q, k_cache, v_cache, table, seq_lens, scale)
    plain_err = (plain.double() - ref).abs().max().item()
    for out in outs:
        err = (out.double() - ref).abs().max().item()
        info = f"{context} err={err:.3g} plain={plain_err:.3g}"
        assert torch.isfinite(out).all(), "NaN/inf in output: " + info
        assert err <= 2 * plain_err + 1e-6, info


def poison(workspace, out_shape, dtype):
    workspace.partial_out.fill_(float("nan"))
    workspace.partial_lse.fill_(float("nan"))
    # The next allocation of this size reuses the block: an output element left unwritten shows as NaN.
    torch.full(out_shape, float("nan"), device=DEVICE, dtype=dtype)


def check_against_oracle(lengths, num_q, num_kv, head_dim, block_size, dtype, num_splits=None, workspace=None,
                         seed=None, min_chunk=None, merge_mode=None, spread=False, ring_stages=0, copy_rows=0,
                         warp_tokens=0):
    k_cache, v_cache, table, seq_lens = make_paged(lengths, num_kv, head_dim, block_size, dtype)
    batch = len(lengths)
    q = torch.randn(batch, num_q, head_dim, device=DEVICE, dtype=dtype)
    scale = head_dim ** -0.5
    if workspace is None:
        workspace = kernels.Workspace(batch, num_q, head_dim, table.shape[1] * block_size, DEVICE,
                                      num_kv_heads=num_kv)
    poison(workspace, q.shape, dtype)
    if min_chunk is None and merge_mode is None and not (spread or ring_stages or copy_rows or warp_tokens):
        out = kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, scale=scale, workspace=workspace,
                                   num_splits=num_splits)
    else:  # another merge mode, or smaller device-side chunks: more non-empty splits to merge
        out = ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, scale=scale, workspace=workspace,
                                    num_splits=num_splits, min_chunk=min_chunk, merge_mode=merge_mode,
                                    spread=spread, ring_stages=ring_stages, copy_rows=copy_rows,
                                    warp_tokens=warp_tokens)
    assert out.shape == q.shape and out.dtype == dtype
    splits = num_splits or workspace.num_splits(batch)
    assert_accurate([out], q, k_cache, v_cache, table, seq_lens, scale,
                    f"seed={seed} lengths={lengths[:8]}... splits={splits} mode={merge_mode}")
    return out


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_float64(dtype, head_dim, group, block_size, fresh_seed):
    num_kv = 2
    lengths = [1, 65, block_size - 1, block_size + 1] + torch.randint(1, 3000, (3,)).tolist()
    check_against_oracle(lengths, group * num_kv, num_kv, head_dim, block_size, dtype, seed=fresh_seed)


@pytest.mark.parametrize("min_chunk", [None, 1])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64, 129, 255, 256])
@pytest.mark.parametrize("length", [1, 100, 4097, 20000])
def test_every_split_count_single_sequence(num_splits, length, min_chunk, fresh_seed):
    ws = kernels.Workspace(1, 8, 128, length + 64, DEVICE, num_kv_heads=2, max_splits=256)
    check_against_oracle([length], 8, 2, 128, 32, torch.bfloat16, num_splits=num_splits, workspace=ws,
                         seed=fresh_seed, min_chunk=min_chunk)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16, 33])
def test_split_counts_ragged_batch(num_splits, fresh_seed):
    lengths = [1, 2, 63, 64, 65, 1000, 4095, 9999]
    # A workspace planned for up to 8 * num_splits sequences has room for 8 x num_splits rows.
    ws = kernels.Workspace(8 * num_splits, 12, 64, 10240, DEVICE, num_kv_heads=4, max_splits=64)
    check_against_oracle(lengths, 12, 4, 64, 16, torch.float16, num_splits=num_splits, workspace=ws, seed=fresh_seed,
                         min_chunk=1)


@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_ragged_batches(batch, fresh_seed):
    lengths = torch.randint(1, 2049, (batch,)).tolist()
    lengths[0] = 1
    check_against_oracle(lengths, 8, 2, 128, DEFAULT_BLOCK_SIZE, torch.bfloat16, seed=fresh_seed)


@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128)])
def test_long_sequences(shape, fresh_seed):
    num_q, num_kv, dim = shape
    check_against_oracle([131072, 77777], num_q, num_kv, dim, DEFAULT_BLOCK_SIZE, torch.bfloat16, seed=fresh_seed)


@pytest.mark.parametrize("num_q,num_kv", [(20, 1), (64, 2)])
def test_groups_larger_than_one_block(num_q, num_kv, fresh_seed):
    check_against_oracle([5, 700, 3333], num_q, num_kv, 64, 64, torch.bfloat16, seed=fresh_seed)


@pytest.mark.parametrize("block_size", [64, 128, 256, 384])
def test_large_blocks(block_size, fresh_seed):
    check_against_oracle([1, 130, 5000], 8, 2, 128, block_size, torch.float16, seed=fresh_seed)


def test_merge_modes_agree():
    """Every mode that merges by kernel does the same arithmetic (bit for bit), and so do the
    cluster modes once a split count is too large for one cluster (they fall back to the kernel).
    The last-block merge sums the splits in another order: within one bf16 step of the others."""
    k_cache, v_cache, table, seq_lens = make_paged([3000, 17, 1], 2, 128, 32, torch.bfloat16)
    q = torch.randn(3, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    ws = kernels.Workspace(3, 8, 128, 4096, DEVICE, num_kv_heads=2, max_splits=64)

    def run(mode, splits, spread=False):
        return ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, workspace=ws, num_splits=splits,
                                     merge_mode=mode, min_chunk=1, spread=spread)
    outs = [run(m, 12) for m in (ops.MERGE_KERNEL, ops.MERGE_KERNEL_PDL, ops.MERGE_PDL_CHAIN, ops.MERGE_PDL_LATE,
                                 ops.MERGE_AUTO, ops.MERGE_PDL_LOADS)]
    outs.append(run(ops.MERGE_KERNEL_PDL, 12, spread=True))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    for _ in range(2):  # twice: the counters it leaves must be zero for the next call
        last_block = run(ops.MERGE_LAST_BLOCK, 12)
        one_step = outs[0].abs().float() * 2.0 ** -7 + 1e-30
        assert ((last_block.float() - outs[0].float()).abs() <= one_step).all()
    assert torch.count_nonzero(ws.merge_counters) == 0
    wide = [run(m, 17) for m in (ops.MERGE_KERNEL_PDL, ops.MERGE_CLUSTER, ops.MERGE_CLUSTER_PDL,
                                 ops.MERGE_CLUSTER_PDL_LOADS)]
    for out in wide[1:]:
        assert torch.equal(out, wide[0])


@pytest.mark.parametrize("merge_mode", [ops.MERGE_KERNEL_PDL, ops.MERGE_PDL_CHAIN])
@pytest.mark.parametrize("shape,num_splits", [((32, 8, 128), 16), ((32, 8, 128), 32), ((32, 8, 128), 33),
                                              ((9, 3, 64), 16), ((9, 3, 64), 44), ((9, 3, 64), 64), ((9, 3, 64), 65)])
def test_merge_in_one_trip_equals_two(shape, num_splits, merge_mode):
    """The merge kernel's row in one round trip (the weights derived by every warp while the
    partial rows load; the default from 16 splits) gives the same bits as in two
    (``merge_one_trip=False``); past 64 splits at head_dim 64 (32 at 128) it takes two. Lengths 17
    and 1 leave most splits empty: their partial rows hold NaN."""
    num_q, num_kv, dim = shape
    k_cache, v_cache, table, seq_lens = make_paged([3000, 17, 1], num_kv, dim, 32, torch.bfloat16)
    q = torch.randn(3, num_q, dim, device=DEVICE, dtype=torch.bfloat16)
    ws = kernels.Workspace(3 * num_splits, num_q, dim, 4096, DEVICE, num_kv_heads=num_kv, max_splits=128)
    outs = []
    for one_trip in (False, True):
        poison(ws, q.shape, q.dtype)
        outs.append(ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, workspace=ws, num_splits=num_splits,
                                          merge_mode=merge_mode, min_chunk=1, merge_one_trip=one_trip))
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("merge_mode", [ops.MERGE_CLUSTER, ops.MERGE_CLUSTER_PDL, ops.MERGE_PDL_LATE, ops.MERGE_AUTO,
                                        ops.MERGE_PDL_LOADS, ops.MERGE_CLUSTER_PDL_LOADS])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8, 11, 16, 17])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128), (20, 1, 64)])
def test_cluster_and_late_trigger_modes(merge_mode, num_splits, shape, spread, fresh_seed):
    """Ragged lengths leave some splits of a cluster empty (length 1 leaves all but one)."""
    num_q, num_kv, dim = shape
    lengths = [1, 300, 4097] + torch.randint(1, 5000, (2,)).tolist()
    # max_batch sized so that the workspace holds every split of every sequence
    ws = kernels.Workspace(len(lengths) * num_splits, num_q, dim, 5200, DEVICE, num_kv_heads=num_kv, max_splits=32)
    for min_chunk in (None, 1):
        check_against_oracle(lengths, num_q, num_kv, dim, 32, torch.bfloat16, num_splits=num_splits,
                             workspace=ws, seed=fresh_seed, min_chunk=min_chunk, merge_mode=merge_mode,
                             spread=spread)


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("merge_mode", [ops.MERGE_AUTO, ops.MERGE_CLUSTER_PDL, ops.MERGE_KERNEL_PDL])
@pytest.mark.parametrize("num_splits", [1, 2, 5, 17])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128)])
def test_ring_depths(shape, num_splits, merge_mode, spread, fresh_seed):
    """A ring of 1 to 6 stages (each wrapping many times over these lengths) changes when tiles
    arrive, never which warp sums which tokens: every depth gives the same bits, and they match
    the float64 oracle."""
    num_q, num_kv, dim = shape
    lengths = [1, 250, 9000] + torch.randint(1, 20000, (2,)).tolist()
    ws = kernels.Workspace(len(lengths) * num_splits, num_q, dim, 20032, DEVICE, num_kv_heads=num_kv,
                           max_splits=32)
    outs = []
    for ring in range(ops.MAX_RING_STAGES + 1):
        torch.manual_seed(fresh_seed)  # the same cache and queries for every depth
        outs.append(check_against_oracle(lengths, num_q, num_kv, dim, 32, torch.bfloat16, num_splits=num_splits,
                                         workspace=ws, seed=fresh_seed, merge_mode=merge_mode, spread=spread,
                                         ring_stages=ring).clone())
    for ring, out in enumerate(outs[1:], start=1):
        assert torch.equal(out, outs[0]), f"ring {ring} differs from the launcher's choice"


@pytest.mark.parametrize("plan", [{}, {"num_splits": 3, "merge_mode": ops.MERGE_PDL_CHAIN},
                                  {"num_splits": 3, "merge_mode": ops.MERGE_PDL_CHAIN, "spread": True,
                                   "ring_stages": 5}], ids=["auto", "kernel merge", "spread, ring of 5"])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128)])
def test_read_ahead_depths(shape, plan, fresh_seed):
    """How many tiles a block asks for before its predecessor finishes (1 up to past the ring's
    depth, which the ring caps) changes when they arrive, never the bits; eager and under graph
    replay. (Whether it waits for what its predecessor writes: test_read_ahead_waits_for_the_new_row_and_q.)"""
    num_q, num_kv, dim = shape
    lengths = [1, 130, 2049, 9000]
    k_cache, v_cache, table, seq_lens = make_paged(lengths, num_kv, dim, 32, torch.bfloat16)
    ws = kernels.Workspace(len(lengths), num_q, dim, table.shape[1] * 32, DEVICE, num_kv_heads=num_kv)
    q = torch.randn(len(lengths), num_q, dim, device=DEVICE, dtype=torch.bfloat16)
    outs = []
    for ahead in range(ops.MAX_RING_STAGES + 1):
        poison(ws, q.shape, q.dtype)
        outs.append(ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, workspace=ws, ahead_tiles=ahead,
                                          **plan))
    assert_accurate(outs, q, k_cache, v_cache, table, seq_lens, dim ** -0.5)
    for ahead, out in enumerate(outs[1:], start=1):
        assert torch.equal(out, outs[0]), f"ahead_tiles={ahead} differs from the launcher's choice"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, workspace=ws, ahead_tiles=1,
                                           **plan)
    static_out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(static_out, outs[0])


@pytest.mark.parametrize("ring_stages", [0, 1])
@pytest.mark.parametrize("num_splits,merge_mode,spread", [
    (1, None, False)] + [(n, mode, spread) for n in (3, 16) for mode, spread in [
        (None, False), (ops.MERGE_KERNEL_PDL, False), (ops.MERGE_CLUSTER_PDL_LOADS, True), (ops.MERGE_LAST_BLOCK, False)]])
@pytest.mark.parametrize("dtype,group,block_size", [(torch.bfloat16, 1, 16), (torch.float16, 3, 32),
                                                    (torch.bfloat16, 4, 256), (torch.float16, 8, 64)])
@pytest.mark.parametrize("warp_tokens", [16, 32])
def test_consumer_warp_layouts(warp_tokens, dtype, group, block_size, num_splits, merge_mode, spread, ring_stages,
                               fresh_seed):
    """Head_dim 64 with four consumer warps of 32 tokens each (the default for groups of at most
    eight heads) and with eight of 16: lengths that end inside a warp's first or second 16 tokens,
    one stage that the producer refills at once, every merge. (32 tokens for groups of more than
    eight heads are refused: tested with the other bad input.)"""
    num_kv = 2
    lengths = [1, 17, 33, 127, 2000] + torch.randint(1, 5000, (2,)).tolist()
    ws = kernels.Workspace(len(lengths) * num_splits, group * num_kv, 64, 5024, DEVICE, num_kv_heads=num_kv,
                           max_splits=16)
    check_against_oracle(lengths, group * num_kv, num_kv, 64, block_size, dtype, num_splits=num_splits,
                         workspace=ws, seed=fresh_seed, merge_mode=merge_mode, spread=spread,
                         ring_stages=ring_stages, warp_tokens=warp_tokens)


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 2, 64)])
def test_three_blocks_per_sm(shape, fresh_seed):
    """Two splits whose blocks fill one wave of three per SM: the launcher runs them as four-warp
    blocks with rings of two stages merging in clusters of two. Ragged lengths (1 leaves split 1
    empty), eager against the float64 oracle, then graph replay equal to eager."""
    num_q, num_kv, dim = shape
    batch = 3 * torch.cuda.get_device_properties(DEVICE).multi_processor_count // (2 * num_kv)
    lengths = [1, 130, 4096] + torch.randint(1, 4097, (batch - 3,)).tolist()
    k_cache, v_cache, table, seq_lens = make_paged(lengths, num_kv, dim, 32, torch.bfloat16)
    ws = kernels.Workspace(batch, num_q, dim, 4096, DEVICE, num_kv_heads=num_kv)
    assert ws.num_splits(batch) == 2                          # the planner's plan for this grid
    assert ws.num_splits(batch, three_per_sm=False) == 1      # for calls that rule it out
    q = torch.randn(batch, num_q, dim, device=DEVICE, dtype=torch.bfloat16)
    poison(ws, q.shape, q.dtype)
    eager = ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, workspace=ws)
    assert_accurate([eager], q, k_cache, v_cache, table, seq_lens, dim ** -0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, workspace=ws)
    static_out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(static_out, eager)


# Every copy size the op accepts: a multiple of 8 dividing both the page and the tile.
COPY_ROWS_CASES = [(shape, block_size, rows) for shape in [(9, 3, 64), (32, 8, 128)] for block_size in [16, 32, 64, 256]
                   for rows in [8, 16, 32, 64] if min(block_size, ops.tile_tokens(shape[2])) % rows == 0]


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("shape,block_size,copy_rows", COPY_ROWS_CASES)
def test_rows_per_bulk_copy(shape, block_size, copy_rows, num_splits, fresh_seed):
    """A tile fetched in smaller bulk copies than a page (or than a tile, for large pages), by the
    blocks of at least kCopyRowsMinTiles (8) tiles; shorter ones copy whole pages."""
    num_q, num_kv, dim = shape
    lengths = [1, 17, 130, 1000, 2049, 4097]
    check_against_oracle(lengths, num_q, num_kv, dim, block_size, torch.bfloat16, num_splits=num_splits,
                         seed=fresh_seed, copy_rows=copy_rows)


@pytest.mark.parametrize("merge_mode", [ops.MERGE_KERNEL_PDL, ops.MERGE_PDL_LATE, ops.MERGE_CLUSTER_PDL,
                                        ops.MERGE_PDL_LOADS, ops.MERGE_CLUSTER_PDL_LOADS, None])
def test_graph_replay_equals_eager(merge_mode):
    batch, num_q, num_kv, dim, bs = 6, 9, 3, 64, 16
    k_cache, v_cache, table, seq_lens = make_paged([4000] * batch, num_kv, dim, bs, torch.bfloat16)
    ws = kernels.Workspace(batch, num_q, dim, table.shape[1] * bs, DEVICE, num_kv_heads=num_kv)
    q = torch.randn(batch, num_q, dim, device=DEVICE, dtype=torch.bfloat16)
    key = torch.randn(batch, num_kv, dim, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.zeros(batch, dtype=torch.int64, device=DEVICE)

    def step():
        kernels.write_kv(k_cache, v_cache, key, value, slots)
        return ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, workspace=ws, merge_mode=merge_mode)

    def new_inputs(round_):
        lens = torch.randint(1, 3999, (batch,), dtype=torch.int32)
        lens[-1] = 1
        seq_lens.copy_(lens)
        positions = (lens - 1).long().to(DEVICE)
        slot = table.gather(1, (positions // bs).view(-1, 1)).view(-1).long() * bs + positions % bs
        slot[round_ % batch] = -1                            # a padded row writes nothing
        slots.copy_(slot)
        q.copy_(torch.randn_like(q))
        key.copy_(torch.randn_like(key))
        value.copy_(torch.randn_like(value))

    new_inputs(0)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                               # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for round_ in range(1, 4):
        new_inputs(round_)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        static_out.fill_(float("nan"))
        ws.partial_out.fill_(float("nan"))
        graph.replay()
        replayed, k_after, v_after = static_out.clone(), k_cache.clone(), v_cache.clone()
        k_cache.copy_(k_before)
        v_cache.copy_(v_before)
        eager = step()
        assert torch.equal(replayed, eager)
        assert torch.equal(k_after.nan_to_num(7.0), k_cache.nan_to_num(7.0))
        assert torch.equal(v_after.nan_to_num(7.0), v_cache.nan_to_num(7.0))
        assert_accurate([replayed], q, k_cache, v_cache, table, seq_lens, dim ** -0.5)


# Launch plans the read-ahead runs under: the launcher's choice (a spread grid merging by kernel at
# B=4), one split triggering once its loads are issued, two-split clusters doing the same, and a
# spread grid with a ring of five stages merging by kernel.
READ_AHEAD_PLANS = {"auto": {}, "one split": {"num_splits": 1, "merge_mode": ops.MERGE_PDL_LOADS},
                    "cluster": {"num_splits": 2, "merge_mode": ops.MERGE_CLUSTER_PDL_LOADS},
                    "deep ring": {"num_splits": 3, "merge_mode": ops.MERGE_PDL_CHAIN, "spread": True,
                                  "ring_stages": 5}}
# At head_dim 64 the plans run again with eight consumer warps of 16 tokens (the default is four of 32).
READ_AHEAD_CASES = [(shape, plan, warp_tokens) for shape in [(9, 3, 64), (32, 8, 128)] for plan in READ_AHEAD_PLANS
                    for warp_tokens in ([0, 16] if shape[2] == 64 else [0])]
# Tiles read ahead: none (read_ahead=False), the launcher's choice, one, and up to the whole ring;
# blocks of 128 tokens too (a page to a tile at head_dim 64), under graph replay, where the overlap is.
READ_AHEAD_DEPTHS = ([(bs, graph, ahead) for bs in [DEFAULT_BLOCK_SIZE] for graph in [False, True]
                      for ahead in [None, 0, 1, ops.MAX_RING_STAGES]]
                     + [(128, True, ahead) for ahead in [0, ops.MAX_RING_STAGES]])


@pytest.mark.parametrize("block_size,graph,ahead_tiles", READ_AHEAD_DEPTHS)
@pytest.mark.parametrize("shape,plan,warp_tokens", READ_AHEAD_CASES)
def test_read_ahead_waits_for_the_new_row_and_q(shape, plan, warp_tokens, block_size, graph, ahead_tiles,
                                                fresh_seed):
    """A decode step's chain, as the engine runs it: projections, then the rotary embedding that
    rotates q in place and writes row len - 1 of the cache, then flash_decode twice. Each is a PDL
    kernel that lets its successor in at once, so under graph replay flash_decode reads ahead while
    the chain still runs, and the second call reads ahead while the first one's merge still reads
    the workspace. Row len - 1 holds NaN until the write lands; a split that read it early drops
    out of the merge (its softmax total is not > 0), so the check is the accuracy, not NaN. Eager,
    the host's launch gaps keep the kernels apart: the same arithmetic, without the overlap."""
    num_q, num_kv, dim = shape
    bs, batch, hidden = block_size, 4, 2048
    read_ahead = ahead_tiles is not None
    lengths = [37, 129, 300, 2500]        # one tile, two, three at D=64 (the default ring), several splits
    k_cache, v_cache, table, seq_lens = make_paged(lengths, num_kv, dim, bs, torch.bfloat16)
    ws = kernels.Workspace(batch, num_q, dim, table.shape[1] * bs, DEVICE, num_kv_heads=num_kv)
    positions = seq_lens - 1
    slots = table.gather(1, (positions // bs).long().view(-1, 1)).view(-1).long() * bs + (positions % bs).long()
    angles = torch.arange(max(lengths), device=DEVICE).view(-1, 1) / 10000.0 ** (
        torch.arange(0, dim, 2, device=DEVICE) / dim)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float().contiguous()
    x = torch.empty(batch, hidden, device=DEVICE, dtype=torch.bfloat16)
    deep = [torch.randn(hidden, hidden, device=DEVICE, dtype=torch.bfloat16) / hidden ** 0.5 for _ in range(3)]
    narrow = torch.randn(512, hidden, device=DEVICE, dtype=torch.bfloat16) / hidden ** 0.5
    qkv_w = torch.randn((num_q + 2 * num_kv) * dim, 512, device=DEVICE, dtype=torch.bfloat16) / 512 ** 0.5
    assert all(layer_ops._gemv_serves(x, w) for w in deep + [narrow])   # our PDL GEMV, not cuBLAS
    assert layer_ops._gemv_serves(x[:, :512], qkv_w)

    def step():
        h = x
        for w in deep + [narrow]:
            h = layer_ops.linear(h, w)
        qkv = layer_ops.linear(h, qkv_w)
        layer_ops.rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slots, num_q)
        q = qkv[:, :num_q * dim].unflatten(1, (num_q, dim))
        outs = [ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, workspace=ws, read_ahead=read_ahead,
                                      ahead_tiles=ahead_tiles or 0, warp_tokens=warp_tokens,
                                      **READ_AHEAD_PLANS[plan]) for _ in range(2)]
        return q, outs

    def new_round():
        x.copy_(torch.randn_like(x))
        for slot in slots.tolist():
            k_cache[slot // bs, :, slot % bs] = float("nan")
            v_cache[slot // bs, :, slot % bs] = float("nan")
        ws.partial_out.fill_(float("nan"))

    if graph:
        new_round()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            static_q, static_outs = step()
    for _ in range(3):
        new_round()
        if graph:
            for out in static_outs:
                out.fill_(float("nan"))
            captured.replay()
            q, outs = static_q, static_outs
        else:
            q, outs = step()
        torch.cuda.synchronize()
        assert_accurate(outs, q, k_cache, v_cache, table, seq_lens, dim ** -0.5)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128)])
def test_write_kv_matches_reference(dtype, head_dim, slot_dtype):
    num_blocks, num_kv, bs, tokens = 40, 3, 16, 50
    k_cache = torch.randn(num_blocks, num_kv, bs, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    fused = torch.randn(tokens, 2 * num_kv + 1, head_dim, device=DEVICE, dtype=dtype)
    key, value = fused[:, :num_kv], fused[:, num_kv + 1:]      # strided views, as from a fused projection
    slots = torch.randperm(num_blocks * bs)[:tokens].to(slot_dtype)
    slots[::7] = -1
    slots = slots.to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference_write_kv(k_ref, v_ref, key, value, slots)
    kernels.write_kv(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_rejects_unsupported_inputs():
    k_cache, v_cache, table, seq_lens = make_paged([10, 20], 2, 64, 16, torch.bfloat16)
    q = torch.randn(2, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        kc = torch.zeros(4, 2, 16, 96, device=DEVICE, dtype=torch.bfloat16)
        kernels.flash_decode(torch.zeros(2, 4, 96, device=DEVICE, dtype=torch.bfloat16), kc, kc.clone(), table,
                             seq_lens)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        kernels.flash_decode(q.float(), k_cache.float(), v_cache.float(), table, seq_lens)
    with pytest.raises(ValueError, match="int32"):
        kernels.flash_decode(q, k_cache, v_cache, table.long(), seq_lens)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.flash_decode(q[:, :3], k_cache, v_cache, table, seq_lens)
    with pytest.raises(ValueError, match="block_size"):
        kc = torch.zeros(4, 2, 24, 64, device=DEVICE, dtype=torch.bfloat16)
        kernels.flash_decode(q, kc, kc.clone(), table, seq_lens)
    with pytest.raises(ValueError, match="merge_mode"):
        ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, merge_mode=len(ops.MERGE_MODES))
    for rows in (-8, 12, 24):
        with pytest.raises(ValueError, match="copy_rows"):
            ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, copy_rows=rows)
    for ring in (-1, ops.MAX_RING_STAGES + 1):
        with pytest.raises(ValueError, match="ring_stages"):
            ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, ring_stages=ring)
    for ahead in (-1, ops.MAX_RING_STAGES + 1):
        with pytest.raises(ValueError, match="ahead_tiles"):
            ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, ahead_tiles=ahead)
    for tokens in (8, 24, 64):
        with pytest.raises(ValueError, match="warp_tokens"):
            ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, warp_tokens=tokens)
    q_wide_group = torch.zeros(2, 18, 64, device=DEVICE, dtype=torch.bfloat16)  # 9 heads per KV head
    with pytest.raises(ValueError, match="warp_tokens"):
        ops.flash_decode_cuda(q_wide_group, k_cache, v_cache, table, seq_lens, warp_tokens=32)
    q128, kc128 = (torch.zeros(2, 4, 128, device=DEVICE, dtype=torch.bfloat16),
                   torch.zeros(4, 2, 16, 128, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="warp_tokens"):
        ops.flash_decode_cuda(q128, kc128, kc128.clone(), table, seq_lens, warp_tokens=32)


def test_no_host_sync_and_no_allocation_but_output():
    k_cache, v_cache, table, seq_lens = make_paged([300, 5000], 2, 128, 32, torch.bfloat16)
    q = torch.randn(2, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    ws = kernels.Workspace(2, 8, 128, table.shape[1] * 32, DEVICE, num_kv_heads=2)
    kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, workspace=ws)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, workspace=ws)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == 1
    assert torch.isfinite(out).all()


def test_default_workspace_matches_explicit():
    k_cache, v_cache, table, seq_lens = make_paged([1, 900, 3000], 2, 64, 32, torch.float16)
    q = torch.randn(3, 6, 64, device=DEVICE, dtype=torch.float16)
    out = kernels.flash_decode(q, k_cache, v_cache, table, seq_lens)
    ws = kernels.Workspace(3, 6, 64, table.shape[1] * 32, DEVICE, num_kv_heads=2)
    assert torch.equal(out, kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, workspace=ws))


def test_torch_compile_sees_one_op():
    import torch._dynamo
    k_cache, v_cache, table, seq_lens = make_paged([700, 33], 2, 64, 16, torch.bfloat16)
    ws = kernels.Workspace(2, 8, 64, table.shape[1] * 16, DEVICE, num_kv_heads=2)
    q = torch.randn(2, 8, 64, device=DEVICE, dtype=torch.bfloat16)
    key = torch.randn(2, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.tensor([699, -1], dtype=torch.int64, device=DEVICE)
    slots[0] = table[0, 699 // 16].long() * 16 + 699 % 16

    def step(q, k_cache, v_cache, key, value):
        kernels.write_kv(k_cache, v_cache, key, value, slots)
        return kernels.flash_decode(q * 1.0, k_cache, v_cache, table, seq_lens, workspace=ws)

    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    eager = step(q, k_eager, v_eager, key, value)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, key, value)
    assert torch.equal(compiled, eager)
    assert torch.equal(k_cache.nan_to_num(7.0), k_eager.nan_to_num(7.0))
