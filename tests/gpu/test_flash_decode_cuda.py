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
from kernels.reference import gather_dense, reference_write_kv, split_decode

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


def capture(step):
    """``step`` run once on a side stream (outside capture), then captured: (graph, its outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def make_paged(lengths, num_kv_heads, head_dim, block_size, dtype, spare_blocks=3, table_blocks=None):
    """A random paged cache whose rows past each sequence's end, and unused blocks, are NaN; its
    block table has ``table_blocks`` columns (default: two past the longest sequence's)."""
    lengths = [int(n) for n in lengths]
    batch = len(lengths)
    per_seq = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(per_seq) + spare_blocks
    max_blocks = table_blocks or max(per_seq) + 2
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


def oracle(q, k_cache, v_cache, table, seq_lens, scale, window=None):
    """float64 attention (the repo's reference with one split), over the last ``window`` positions."""
    k64, v64 = (c.double().nan_to_num(0.0) for c in (k_cache, v_cache))
    return split_decode(q.double(), k64, v64, table, seq_lens, 1, scale=scale, window=window)


def plain_low_precision(q, k_cache, v_cache, table, seq_lens, scale, window=None):
    """Plain PyTorch attention in the input dtype (scores, softmax and P V all low precision)."""
    width = int(seq_lens.max())
    k = gather_dense(k_cache.nan_to_num(0.0), table, width)
    v = gather_dense(v_cache.nan_to_num(0.0), table, width)
    batch, num_q, dim = q.shape
    num_kv = k.shape[1]
    qg = q.view(batch, num_kv, num_q // num_kv, dim)
    scores = torch.einsum("bhgd,bhnd->bhgn", qg, k) * scale
    positions = torch.arange(width, device=q.device).view(1, 1, 1, width)
    mask = positions >= seq_lens.view(batch, 1, 1, 1)
    if window is not None:
        mask |= positions < seq_lens.view(batch, 1, 1, 1) - window
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1).to(q.dtype)
    return torch.einsum("bhgn,bhnd->bhgd", probs, v).reshape(batch, num_q, dim)


def assert_accurate(outs, q, k_cache, v_cache, table, seq_lens, scale, context="", window=None):
    """The criterion of every test here, for outputs of the same inputs: finite, and their error
    against float64 attention at most twice plain attention's in q's dtype over the same cache
    (for an int8 cache: the dequantised float32 one, NaN past each end)."""
    ref = oracle(q, k_cache, v_cache, table, seq_lens, scale, window)
    plain = plain_low_precision(q, k_cache.to(q.dtype), v_cache.to(q.dtype), table, seq_lens, scale, window)
    assert_within_twice_plain(outs, ref, plain, context)


def assert_within_twice_plain(outs, ref, plain, context=""):
    """Each output finite, and its max error against the float64 ``ref`` at most twice that of
    ``plain`` (attention of the same inputs in q's dtype)."""
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


def check_against_oracle(lengths, num_q, num_kv, head_dim, block_size, dtype, workspace=None, seed=None,
                         window=None):
    """``workspace`` None: one planned for the block table's reach (and ``window``); else its table
    reaches no further than the workspace's longest sequence."""
    table_blocks = None if workspace is None else -(-workspace.max_seq_len // block_size)
    k_cache, v_cache, table, seq_lens = make_paged(lengths, num_kv, head_dim, block_size, dtype,
                                                   table_blocks=table_blocks)
    return decode_and_check((k_cache, v_cache), table, seq_lens, num_q, dtype, workspace, window,
                            f"seed={seed} lengths={lengths[:8]}...")


def decode_and_check(caches, table, seq_lens, num_q, dtype, workspace, window, context, oracle_caches=None,
                     k_scale=None, v_scale=None):
    """One decode call over ``caches`` (int8 with ``k_scale``/``v_scale``) on fresh queries and a
    poisoned workspace, checked with ``assert_accurate`` against ``oracle_caches`` (default: the
    caches themselves)."""
    num_kv, block_size, head_dim = caches[0].shape[1:]
    batch = table.shape[0]
    q = torch.randn(batch, num_q, head_dim, device=DEVICE, dtype=dtype)
    scale = head_dim ** -0.5
    if workspace is None:
        workspace = kernels.Workspace(batch, num_q, head_dim, table.shape[1] * block_size, DEVICE,
                                      num_kv_heads=num_kv, windows=(window,), kv_int8=k_scale is not None)
    poison(workspace, q.shape, dtype)
    out = kernels.flash_decode(q, *caches, table, seq_lens, scale=scale, workspace=workspace, window=window,
                               k_scale=k_scale, v_scale=v_scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert_accurate([out], q, *(oracle_caches or caches), table, seq_lens, scale,
                    f"{context} window={window} plan={workspace.plan(batch, window)}", window)
    return out


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", [1, 3, 4, 8, 12])      # at head_dim 64: four warps of 32 tokens up to 8
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_float64(dtype, head_dim, group, block_size, fresh_seed):
    num_kv = 2
    lengths = [1, 65, block_size - 1, block_size + 1] + torch.randint(1, 3000, (3,)).tolist()
    check_against_oracle(lengths, group * num_kv, num_kv, head_dim, block_size, dtype, seed=fresh_seed)


# Head layouts, batches and longest sequences whose plans take each branch of the launch policy
# on the H200's 132 SMs (flash_decode.cu, launch_typed): (Hq, Hkv, D), B, the workspace's longest
# sequence. Lengths 1 and short ones leave splits empty.
PLAN_CASES = {
    "one split, more than two blocks per SM": ((9, 3, 64), 100, 4096),
    "one split, two per SM, trigger at loads": ((9, 3, 64), 64, 512),
    "one split, one spread wave": ((32, 8, 128), 16, 256),
    "two splits in a spread cluster": ((9, 3, 64), 1, 512),
    "sixteen splits in a spread cluster": ((9, 3, 64), 1, 4096),
    "spread, merge kernel": ((9, 3, 64), 8, 4096),
    "spread, 44 splits: one-trip merge kernel": ((9, 3, 64), 1, 32768),
    "128 splits: two-trip merge kernel": ((8, 1, 128), 1, 32768),
    "two per SM, three splits, merge kernel after the split grid": ((32, 8, 128), 11, 4096),
    "groups of 20: two head blocks per KV head": ((40, 2, 64), 1, 32768),
    "head_dim 128, sixteen splits, merge kernel": ((32, 8, 128), 1, 4096),
    "head_dim 256 (Gemma 3), spread cluster": ((4, 1, 256), 1, 4096),
    "head_dim 256, 128 splits: two-trip merge kernel": ((4, 1, 256), 1, 32768),
    "head_dim 256, sixteen splits: one-trip merge kernel": ((8, 4, 256), 2, 32768),
    "head_dim 256, one split, more than two blocks per SM": ((8, 4, 256), 100, 4096),
    "head_dim 256, groups of 16 (rows r + 8 live)": ((32, 2, 256), 4, 4096),
}


@pytest.mark.parametrize("case", PLAN_CASES)
def test_every_launch_plan(case, fresh_seed):
    (num_q, num_kv, dim), batch, max_len = PLAN_CASES[case]
    lengths = ([max_len, 1, max(1, max_len // 3)] + torch.randint(1, max_len + 1, (batch,)).tolist())[:batch]
    ws = kernels.Workspace(batch, num_q, dim, max_len, DEVICE, num_kv_heads=num_kv)
    check_against_oracle(lengths, num_q, num_kv, dim, 32, torch.bfloat16, workspace=ws, seed=fresh_seed)


@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_ragged_batches(batch, fresh_seed):
    lengths = torch.randint(1, 2049, (batch,)).tolist()
    lengths[0] = 1
    check_against_oracle(lengths, 8, 2, 128, DEFAULT_BLOCK_SIZE, torch.bfloat16, seed=fresh_seed)


@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128), (4, 1, 256)], ids=lambda s: "/".join(map(str, s)))
def test_long_sequences(shape, fresh_seed):
    num_q, num_kv, dim = shape
    check_against_oracle([131072, 77777], num_q, num_kv, dim, DEFAULT_BLOCK_SIZE, torch.bfloat16, seed=fresh_seed)


@pytest.mark.parametrize("num_q,num_kv", [(20, 1), (64, 2)])
def test_groups_larger_than_one_block(num_q, num_kv, fresh_seed):
    check_against_oracle([5, 700, 3333], num_q, num_kv, 64, 64, torch.bfloat16, seed=fresh_seed)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("block_size", [64, 128, 256, 384])
def test_large_blocks(block_size, head_dim, fresh_seed):
    check_against_oracle([1, 130, 5000], 8, 2, head_dim, block_size, torch.float16, seed=fresh_seed)


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 2, 64)])
def test_three_blocks_per_sm(shape, fresh_seed):
    """Two splits whose blocks fill one wave of three per SM: the launcher runs them as four-warp
    blocks with rings of two stages merging in clusters of two. Ragged lengths (1 leaves split 1
    empty), eager against the float64 oracle, then graph replay equal to eager."""
    num_q, num_kv, dim = shape
    batch = 3 * torch.cuda.get_device_properties(DEVICE).multi_processor_count // (2 * num_kv)
    lengths = [1, 130, 4096] + torch.randint(1, 4097, (batch - 3,)).tolist()
    k_cache, v_cache, table, seq_lens = make_paged(lengths, num_kv, dim, 32, torch.bfloat16, table_blocks=4096 // 32)
    ws = kernels.Workspace(batch, num_q, dim, 4096, DEVICE, num_kv_heads=num_kv)
    assert ws.plan(batch) == kernels.Plan(2, three_per_sm=True)    # the planner's plan for this grid
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


def new_decode_rows(round_, table, seq_lens, slots, max_len, block_size):
    """New lengths (the last sequence's 1) and each sequence's new row at its last position, one of
    them a padded row (slot -1) that writes nothing."""
    batch = seq_lens.shape[0]
    lens = torch.randint(1, max_len, (batch,), dtype=torch.int32)
    lens[-1] = 1
    seq_lens.copy_(lens)
    positions = (lens - 1).long().to(DEVICE)
    slot = table.gather(1, (positions // block_size).view(-1, 1)).view(-1).long() * block_size + positions % block_size
    slot[round_ % batch] = -1
    slots.copy_(slot)


def assert_replay_equals_eager(step, caches, new_inputs, workspace, check):
    """``step`` (a cache write, then the kernel) captured once, then over three rounds of
    ``new_inputs(round)``: the replay writes the same cache bits and returns the same output as an
    eager run from the same cache state, and ``check(output)`` holds."""
    new_inputs(0)
    torch.cuda.synchronize()
    graph, static_out = capture(step)
    for round_ in range(1, 4):
        new_inputs(round_)
        before = [c.clone() for c in caches]
        static_out.fill_(float("nan"))
        workspace.partial_out.fill_(float("nan"))
        graph.replay()
        replayed, after = static_out.clone(), [c.clone() for c in caches]
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        eager = step()
        assert torch.equal(replayed, eager)
        for written, cache in zip(after, caches):
            assert torch.equal(written.view(torch.uint8), cache.view(torch.uint8))
        check(replayed)


REPLAY_CASES = ["spread, merge kernel", "two splits in a spread cluster", "one split, two per SM, trigger at loads",
                "two per SM, three splits, merge kernel after the split grid"]


@pytest.mark.parametrize("case", REPLAY_CASES)
def test_graph_replay_equals_eager(case):
    (num_q, num_kv, dim), batch, max_len = PLAN_CASES[case]
    bs = 16
    k_cache, v_cache, table, seq_lens = make_paged([max_len] * batch, num_kv, dim, bs, torch.bfloat16,
                                                   table_blocks=-(-max_len // bs))
    ws = kernels.Workspace(batch, num_q, dim, max_len, DEVICE, num_kv_heads=num_kv)
    q = torch.randn(batch, num_q, dim, device=DEVICE, dtype=torch.bfloat16)
    key = torch.randn(batch, num_kv, dim, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.zeros(batch, dtype=torch.int64, device=DEVICE)

    def step():
        kernels.write_kv(k_cache, v_cache, key, value, slots)
        return ops.flash_decode_cuda(q, k_cache, v_cache, table, seq_lens, workspace=ws)

    def new_inputs(round_):
        new_decode_rows(round_, table, seq_lens, slots, max_len, bs)
        for t in (q, key, value):
            t.copy_(torch.randn_like(t))

    assert_replay_equals_eager(step, [k_cache, v_cache], new_inputs, ws,
                               lambda out: assert_accurate([out], q, k_cache, v_cache, table, seq_lens, dim ** -0.5))


# Launch plans the read-ahead runs under (at B=4, the launcher's choice for the shape); head_dim
# 64 with groups of 3 (four warps of 32 tokens) and of 12 (eight of 16), head_dim 128 and 256.
READ_AHEAD_SHAPES = [(9, 3, 64), (24, 2, 64), (32, 8, 128), (4, 1, 256)]
# Read ahead or not, eager or under graph replay (where the overlap is), and blocks of 128 tokens
# too (a page to a tile at head_dim 64).
READ_AHEAD_RUNS = [(bs, graph, read_ahead) for bs in [32] for graph in [False, True] for read_ahead in [False, True]]
READ_AHEAD_RUNS += [(128, True, True)]


@pytest.mark.parametrize("block_size,graph,read_ahead", READ_AHEAD_RUNS)
@pytest.mark.parametrize("shape", READ_AHEAD_SHAPES, ids=lambda s: "/".join(map(str, s)))
@pytest.mark.parametrize("max_len", [2500, 40000])   # at 40000 tokens the workspace plans more splits
def test_read_ahead_waits_for_the_new_row_and_q(shape, max_len, block_size, graph, read_ahead, fresh_seed):
    """A decode step's chain, as the engine runs it: projections, then the rotary embedding that
    rotates q in place and writes row len - 1 of the cache, then flash_decode twice. Each is a PDL
    kernel that lets its successor in at once, so under graph replay flash_decode reads ahead while
    the chain still runs, and the second call reads ahead while the first one's merge still reads
    the workspace. Row len - 1 holds NaN until the write lands; a split that read it early drops
    out of the merge (its softmax total is not > 0), so the check is the accuracy, not NaN. Eager,
    the host's launch gaps keep the kernels apart: the same arithmetic, without the overlap."""
    num_q, num_kv, dim = shape
    bs, batch, hidden = block_size, 4, 2048
    lengths = [37, 129, 300, 2500]        # one tile, two, three at D=64 (the default ring), several splits
    k_cache, v_cache, table, seq_lens = make_paged(lengths, num_kv, dim, bs, torch.bfloat16)
    ws = kernels.Workspace(batch, num_q, dim, max(max_len, table.shape[1] * bs), DEVICE, num_kv_heads=num_kv)
    positions = seq_lens - 1
    slots = table.gather(1, (positions // bs).long().view(-1, 1)).view(-1).long() * bs + (positions % bs).long()
    angles = torch.arange(max(lengths), device=DEVICE).view(-1, 1) / 10000.0 ** (
        torch.arange(0, dim, 2, device=DEVICE) / dim)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float().contiguous()
    x = torch.empty(batch, hidden, device=DEVICE, dtype=torch.bfloat16)
    deep = [torch.randn(hidden, hidden, device=DEVICE, dtype=torch.bfloat16) / hidden ** 0.5 for _ in range(3)]
    narrow = torch.randn(512, hidden, device=DEVICE, dtype=torch.bfloat16) / hidden ** 0.5
    qkv_w = torch.randn((num_q + 2 * num_kv) * dim, 512, device=DEVICE, dtype=torch.bfloat16) / 512 ** 0.5

    def step():
        h = x
        for w in deep + [narrow, qkv_w]:
            h = torch.ops.flashdecode.gemv(h, w)       # our PDL GEMV (the product's for one or two rows)
        qkv = h
        layer_ops.rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slots, num_q)
        q = qkv[:, :num_q * dim].unflatten(1, (num_q, dim))
        outs = [kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, workspace=ws, read_ahead=read_ahead)
                for _ in range(2)]
        return q, outs

    def new_round():
        x.copy_(torch.randn_like(x))
        for slot in slots.tolist():
            k_cache[slot // bs, :, slot % bs] = float("nan")
            v_cache[slot // bs, :, slot % bs] = float("nan")
        ws.partial_out.fill_(float("nan"))

    if graph:
        new_round()
        captured, (static_q, static_outs) = capture(step)
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
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 256)])
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


def test_workspace_refusals():
    """A workspace that does not fit the call is refused naming both values, as on the CPU."""
    k_cache, v_cache, table, seq_lens = make_paged([10, 2000], 3, 64, 32, torch.bfloat16)
    q = torch.randn(2, 9, 64, device=DEVICE, dtype=torch.bfloat16)
    reach = table.shape[1] * 32
    misfits = [(dict(num_q_heads=9, head_dim=64, max_seq_len=reach, num_kv_heads=9), "num_kv_heads 9.*num_kv_heads 3"),
               (dict(num_q_heads=6, head_dim=64, max_seq_len=reach, num_kv_heads=3), "num_q_heads 6.*num_q_heads 9"),
               (dict(num_q_heads=9, head_dim=128, max_seq_len=reach, num_kv_heads=3), "head_dim 128.*head_dim 64"),
               (dict(num_q_heads=9, head_dim=64, max_seq_len=reach - 32, num_kv_heads=3),
                f"{reach - 32} tokens.*{reach}"),
               (dict(num_q_heads=9, head_dim=64, max_seq_len=reach, num_kv_heads=3, device="cpu"), "on cpu")]
    for fields, message in misfits:
        ws = kernels.Workspace(2, **{"device": DEVICE, **fields})
        with pytest.raises(ValueError, match=message):
            kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, workspace=ws)


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
