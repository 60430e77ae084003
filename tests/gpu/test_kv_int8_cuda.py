"""The int8 KV cache on the GPU: the split kernel against a float64 oracle on the dequantised
cache, the quantising writes bit for bit against the reference quantiser, graph replay, and the
engine's decode step (kernel count, teacher-forced logits, greedy answer).

Criterion for attention (as in test_flash_decode_cuda.py): the kernel's max error against float64
attention over the dequantised cache (code * row scale) is at most twice that of plain PyTorch
attention in q's precision over the same dequantised cache. Caches hold the int8 rows of random
values whose magnitudes differ from row to row by up to 1000x; rows past each sequence's end and
unused blocks hold random codes and NaN scales; outputs and workspaces are poisoned with NaN before
each call. Fresh random inputs every run (the seed is in the test's user properties).
"""

import pytest
import torch

import kernels
from kernels import layer_ops, ops
from kernels.kv_quant import INT8, SCALE_DTYPE, dequantize_rows, new_scales, quantize_rows
from kernels.paging import DEFAULT_BLOCK_SIZE

from .test_flash_decode_cuda import (BLOCK_SIZES, DEVICE, PLAN_CASES, REPLAY_CASES, assert_accurate,  # noqa: F401
                                     assert_replay_equals_eager, decode_and_check, fresh_seed, make_paged,
                                     new_decode_rows, poison)
from .test_layer_ops_cuda import rotary_table

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def int8_paged(lengths, num_kv, head_dim, block_size, table_blocks=None, codes=None):
    """A paged int8 cache of random rows of magnitudes 10^-2..10^1 (or of ``codes(shape)`` at
    random row scales), random codes and NaN scales past each end; returns it with its scales and
    the dequantised float32 cache (NaN past each end) that the oracle reads."""
    ref_k, ref_v, table, seq_lens = make_paged(lengths, num_kv, head_dim, block_size, torch.float32,
                                               table_blocks=table_blocks)
    invalid = torch.isnan(ref_k[..., 0])
    out = []
    for cache in (ref_k, ref_v):
        mags = 10.0 ** torch.empty(cache.shape[:3] + (1,), device=DEVICE).uniform_(-2, 1)
        if codes is None:
            q8, scale = quantize_rows(cache.nan_to_num(0.0) * mags)
        else:
            q8 = codes(cache.shape)
            scale = (mags[..., 0] / 127).to(SCALE_DTYPE)
        q8[invalid] = torch.randint(-128, 128, q8[invalid].shape, device=DEVICE, dtype=INT8)
        scale[invalid] = float("nan")
        deq = dequantize_rows(q8, scale)
        assert torch.isnan(deq[invalid]).all() and torch.isfinite(deq[~invalid]).all()
        out += [q8, scale, deq]
    k8, ks, kd, v8, vs, vd = out
    return k8, v8, ks, vs, kd, vd, table, seq_lens


def check_int8(lengths, num_q, num_kv, head_dim, block_size, dtype, workspace=None, seed=None, codes=None,
               window=None):
    table_blocks = None if workspace is None else -(-workspace.max_seq_len // block_size)
    k8, v8, ks, vs, kd, vd, table, seq_lens = int8_paged(lengths, num_kv, head_dim, block_size, table_blocks, codes)
    return decode_and_check((k8, v8), table, seq_lens, num_q, dtype, workspace, window,
                            f"int8 seed={seed} lengths={lengths[:8]}...", oracle_caches=(kd, vd), k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", [1, 3, 4, 8, 12])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_matches_float64(dtype, head_dim, group, block_size, fresh_seed):
    num_kv = 2
    lengths = [1, 65, block_size - 1, block_size + 1] + torch.randint(1, 3000, (3,)).tolist()
    check_int8(lengths, group * num_kv, num_kv, head_dim, block_size, dtype, seed=fresh_seed)


@pytest.mark.parametrize("window", [1, 17, 32, 512, 5000])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_sliding_window_matches_float64(dtype, head_dim, block_size, window, fresh_seed):
    """int8 caches under a sliding window: rows before the window are copied with their (garbage)
    scales and masked; at head_dim 256 V is read late, one 8-code group at a time."""
    lengths = [1, 2, window, window + 1, 1000, 1025] + torch.randint(1, 3000, (3,)).tolist()
    check_int8(lengths, 8, 2, head_dim, block_size, dtype, seed=fresh_seed, window=window)


@pytest.mark.parametrize("case", PLAN_CASES)
def test_int8_every_launch_plan(case, fresh_seed):
    (num_q, num_kv, dim), batch, max_len = PLAN_CASES[case]
    lengths = ([max_len, 1, max(1, max_len // 3)] + torch.randint(1, max_len + 1, (batch,)).tolist())[:batch]
    ws = kernels.Workspace(batch, num_q, dim, max_len, DEVICE, num_kv_heads=num_kv, kv_int8=True)
    check_int8(lengths, num_q, num_kv, dim, 32, torch.bfloat16, workspace=ws, seed=fresh_seed)


@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_int8_ragged_batches(batch, fresh_seed):
    lengths = torch.randint(1, 2049, (batch,)).tolist()
    lengths[0] = 1
    check_int8(lengths, 8, 2, 128, DEFAULT_BLOCK_SIZE, torch.bfloat16, seed=fresh_seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128)])
def test_int8_long_sequences(shape, dtype, fresh_seed):
    num_q, num_kv, dim = shape
    check_int8([131072, 77777], num_q, num_kv, dim, DEFAULT_BLOCK_SIZE, dtype, seed=fresh_seed)


@pytest.mark.parametrize("num_q,num_kv", [(20, 1), (64, 2)])
def test_int8_groups_larger_than_one_block(num_q, num_kv, fresh_seed):
    check_int8([5, 700, 3333], num_q, num_kv, 64, 64, torch.bfloat16, seed=fresh_seed)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_small_codes_and_scales(head_dim, fresh_seed):
    """Caches of codes -3..3 only at row scales down to 10^-2 / 127: products of P and V scales
    far below fp16's normal range, which the kernel keeps clear of its subnormals."""
    def small(shape):
        return torch.randint(-3, 4, shape, device=DEVICE, dtype=INT8)
    check_int8([1, 300, 2000], 6, 2, head_dim, 32, torch.float16, seed=fresh_seed, codes=small)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_every_code_dequantises_exactly(head_dim, dtype):
    """One cached token: the output is its V row, code * v_scale, exactly (a power-of-two scale
    keeps every product representable in q's dtype); the rows hold every code, -128 included."""
    num_kv = 2
    every = torch.arange(-128, 128, dtype=torch.int16).to(INT8)
    rows = -(-every.numel() // head_dim)
    codes = torch.cat([every, torch.zeros(rows * head_dim - every.numel(), dtype=INT8)]).view(rows, head_dim)
    k8 = torch.zeros(rows, num_kv, 16, head_dim, dtype=INT8)
    k8[:, :, 0] = codes[:, None]
    k8, v8 = k8.to(DEVICE), k8.clone().to(DEVICE)
    ks, vs = new_scales(k8), new_scales(v8)
    ks[:, 0, 0], ks[:, 1, 0] = 2.0 ** -6, 0.5
    vs[:, 0, 0], vs[:, 1, 0] = 2.0 ** -3, 2.0 ** 4
    ks[:, :, 1:] = float("nan")                          # rows past the end
    vs[:, :, 1:] = float("nan")
    table = torch.arange(rows, dtype=torch.int32, device=DEVICE).view(rows, 1)
    seq_lens = torch.ones(rows, dtype=torch.int32, device=DEVICE)
    q = torch.randn(rows, num_kv * 3, head_dim, device=DEVICE, dtype=dtype)
    out = kernels.flash_decode(q, k8, v8, table, seq_lens, k_scale=ks, v_scale=vs)
    expected = dequantize_rows(v8[:, :, 0], vs[:, :, 0], torch.float64).repeat_interleave(3, dim=1).to(dtype)
    assert torch.equal(out, expected), (out - expected).abs().max()


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 2, 64)])
def test_int8_three_blocks_per_sm_and_graph_replay(shape, fresh_seed):
    """The three-per-SM plan (rings of four int8 stages), eager against the oracle, then graph
    replay equal to eager."""
    num_q, num_kv, dim = shape
    batch = 3 * torch.cuda.get_device_properties(DEVICE).multi_processor_count // (2 * num_kv)
    lengths = [1, 130, 4096] + torch.randint(1, 4097, (batch - 3,)).tolist()
    k8, v8, ks, vs, kd, vd, table, seq_lens = int8_paged(lengths, num_kv, dim, 32, table_blocks=4096 // 32)
    ws = kernels.Workspace(batch, num_q, dim, 4096, DEVICE, num_kv_heads=num_kv, kv_int8=True)
    assert ws.plan(batch) == kernels.Plan(2, three_per_sm=True)
    q = torch.randn(batch, num_q, dim, device=DEVICE, dtype=torch.bfloat16)
    poison(ws, q.shape, q.dtype)
    eager = ops.flash_decode_cuda(q, k8, v8, table, seq_lens, workspace=ws, k_scale=ks, v_scale=vs)
    assert_accurate([eager], q, kd, vd, table, seq_lens, dim ** -0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ops.flash_decode_cuda(q, k8, v8, table, seq_lens, workspace=ws, k_scale=ks, v_scale=vs)
    static_out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(static_out, eager)


@pytest.mark.parametrize("case", REPLAY_CASES)
def test_int8_graph_replay_with_the_quantising_write(case, fresh_seed):
    """A decode step's write_kv (quantising, scales included) then flash_decode, captured once
    and replayed over new inputs: replay writes the same codes and scales and equals eager."""
    (num_q, num_kv, dim), batch, max_len = PLAN_CASES[case]
    bs = 16
    k8, v8, ks, vs, _, _, table, seq_lens = int8_paged([max_len] * batch, num_kv, dim, bs,
                                                       table_blocks=-(-max_len // bs))
    ws = kernels.Workspace(batch, num_q, dim, max_len, DEVICE, num_kv_heads=num_kv, kv_int8=True)
    q = torch.randn(batch, num_q, dim, device=DEVICE, dtype=torch.bfloat16)
    key = torch.randn(batch, num_kv, dim, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.zeros(batch, dtype=torch.int64, device=DEVICE)

    def step():
        kernels.write_kv(k8, v8, key, value, slots, ks, vs)
        return ops.flash_decode_cuda(q, k8, v8, table, seq_lens, workspace=ws, k_scale=ks, v_scale=vs)

    def new_inputs(round_):
        new_decode_rows(round_, table, seq_lens, slots, max_len, bs)
        q.copy_(torch.randn_like(q))
        key.copy_(torch.randn_like(key) * 5)
        value.copy_(torch.randn_like(value) * 0.05)

    assert_replay_equals_eager(step, [k8, v8, ks, vs], new_inputs, ws,
                               lambda out: assert_accurate([out], q, dequantize_rows(k8, ks), dequantize_rows(v8, vs),
                                                           table, seq_lens, dim ** -0.5))


def _wide_rows(shape, dtype):
    """Rows of magnitudes from 10^-6 to past the scale cap (127 * 512), zero rows included."""
    mags = 10.0 ** torch.empty(shape[:-1] + (1,), device=DEVICE).uniform_(-6, 5)
    x = torch.randn(shape, device=DEVICE) * mags
    x[::11] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 128),
                                            (torch.bfloat16, 256)])
def test_int8_write_kv_is_bit_exact(dtype, head_dim, slot_dtype):
    """Codes and scales equal to kernels.kv_quant.quantize_rows on the CPU, zero rows, fp16
    subnormal scales and the capped scale included; padded rows (slot -1) and untouched rows keep
    their bytes."""
    tokens, hkv, bs, blocks = 300, 3, 16, 32
    key = _wide_rows((tokens, hkv, head_dim), dtype)
    value = _wide_rows((tokens, hkv, head_dim), dtype).flip(0)
    slots = torch.randperm(blocks * bs, device=DEVICE)[:tokens].to(slot_dtype)
    slots[::7] = -1
    k8 = torch.full((blocks, hkv, bs, head_dim), 0x55, dtype=INT8, device=DEVICE)
    v8 = k8.clone()
    ks = torch.full((blocks, hkv, bs), 3.0, dtype=SCALE_DTYPE, device=DEVICE)
    vs = ks.clone()
    kernels.write_kv(k8, v8, key, value, slots, ks, vs)
    k_ref, v_ref, ks_ref, vs_ref = (t.cpu() for t in (torch.full_like(k8, 0x55), torch.full_like(v8, 0x55),
                                                     torch.full_like(ks, 3.0), torch.full_like(vs, 3.0)))
    kernels.reference_write_kv(k_ref, v_ref, key.cpu(), value.cpu(), slots.cpu(), ks_ref, vs_ref)
    for ours, ref, name in ((k8, k_ref, "k"), (v8, v_ref, "v"), (ks, ks_ref, "k_scale"), (vs, vs_ref, "v_scale")):
        diff = (ours.cpu().view(torch.uint8) != ref.view(torch.uint8)).sum().item()
        assert diff == 0, f"{name}: {diff} bytes differ from kv_quant.quantize_rows"
    assert (ks == 512).any() and (ks == 0).any() and ((ks > 0) & (ks < 2.0 ** -14)).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (4, 1, 256)])
def test_int8_rope_write_kv_is_bit_exact(hq, hkv, d, qk_norm, dtype):
    """The rotary-and-write kernel with int8 caches: q and k rotated in place as with a cache of
    q's dtype, and the caches hold the rows (codes and scales) of the rounded rotated key and of
    the value."""
    tokens, block_size, num_blocks, max_positions = 37, 16, 8, 4096
    table = rotary_table(max_positions, d).float().to(DEVICE)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=DEVICE, dtype=dtype) * 4
    qkv[3] = 0.0                                               # zero rows: scale 0, codes 0
    positions = torch.randint(0, max_positions, (tokens,), device=DEVICE, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens].to(torch.int32)
    slots[::5] = -1
    shape = (num_blocks, hkv, block_size, d)
    k_plain = torch.zeros(shape, device=DEVICE, dtype=dtype)
    v_plain = torch.zeros_like(k_plain)
    k8 = torch.zeros(shape, device=DEVICE, dtype=INT8)
    v8 = torch.zeros_like(k8)
    ks, vs = new_scales(k8), new_scales(v8)
    norms = {}
    if qk_norm:
        norms = dict(q_norm=torch.rand(d, device=DEVICE, dtype=dtype) + 0.5,
                     k_norm=torch.rand(d, device=DEVICE, dtype=dtype) + 0.5, eps=1e-6)
    plain, ours = qkv.clone(), qkv.clone()
    layer_ops.rope_write_kv(plain, positions, table, k_plain, v_plain, slots, hq, **norms)
    layer_ops.rope_write_kv(ours, positions, table, k8, v8, slots, hq, **norms, k_scale=ks, v_scale=vs)
    assert torch.equal(ours, plain)
    for codes, scales, rounded, name in ((k8, ks, k_plain, "k"), (v8, vs, v_plain, "v")):
        exp_codes, exp_scales = quantize_rows(rounded.cpu())
        assert torch.equal(codes.cpu(), exp_codes), f"{name}: codes differ from kv_quant.quantize_rows"
        assert torch.equal(scales.cpu().view(torch.int16), exp_scales.view(torch.int16)), f"{name}: scales differ"


def test_int8_refusals_on_cuda():
    ops.load(DEVICE)                                  # the raw op below needs the library loaded
    k8, v8, ks, vs, _, _, table, seq_lens = int8_paged([40], 2, 64, 16)
    q = torch.randn(1, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale.*v_scale"):
        kernels.flash_decode(q, k8, v8, table, seq_lens)
    with pytest.raises(ValueError, match="k_scale is on cpu"):
        kernels.flash_decode(q, k8, v8, table, seq_lens, k_scale=ks.cpu(), v_scale=vs)
    with pytest.raises(ValueError, match="k_scale and v_scale are for int8 caches only"):
        kernels.flash_decode(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), table, seq_lens, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match=r"v_scale must be contiguous float16 .*got torch.float16 \[\d+, 2, 8\]"):
        kernels.flash_decode(q, k8, v8, table, seq_lens, k_scale=ks, v_scale=vs[:, :, :8].contiguous())
    with pytest.raises(ValueError, match="16-byte aligned"):
        kernels.flash_decode(q, k8, v8, table, seq_lens, k_scale=ks,
                             v_scale=torch.empty(vs.numel() + 1, dtype=SCALE_DTYPE, device=DEVICE)[1:].view(vs.shape))
    key = torch.randn(1, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="bfloat16/float16, got torch.float32"):
        kernels.write_kv(k8, v8, key, key, torch.zeros(1, dtype=torch.int32, device=DEVICE), ks, vs)
    with pytest.raises(RuntimeError, match="k_scale and v_scale are required"):
        torch.ops.flashdecode.write_kv(k8, v8, key.bfloat16(), key.bfloat16(),
                                       torch.zeros(1, dtype=torch.int32, device=DEVICE))


# ---- the engine ---------------------------------------------------------------------------


def _runner(loaded, kv_cache_dtype, **kw):
    from server.engine import EngineConfig
    from server.engine.model_runner import ModelRunner
    config = EngineConfig(max_batch=8, num_blocks=256, block_size=32, graph_buckets=(1, 8), kv_cache_dtype=kv_cache_dtype,
                          **kw)
    return ModelRunner(loaded, config, max_model_len=2048)


@pytest.fixture(scope="module")
def smollm_random():
    from models import load_model
    return load_model("random:smollm2-135m", dtype="bfloat16", device="cuda")


def _decode_kernels(runner, batch=8, context=100):
    """CUDA kernels of one eager decode step of ``batch`` sequences of ``context`` tokens."""
    from torch.profiler import ProfilerActivity, profile
    from server.engine.block_manager import BlockManager
    from server.engine.params import SamplingParams
    from server.engine.sequence import Sequence
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seqs = []
    for i in range(batch):
        seq = Sequence(f"s{i}", [11 + (i * 7 + j) % 3000 for j in range(context)], SamplingParams(), 0)
        blocks.grow(seq.block_table, seq.length + 1)
        seqs.append(seq)
    with torch.inference_mode():
        runner.prefill([(s, s.length) for s in seqs])
        for s in seqs:
            s.num_cached = s.length
            s.append(5)
        runner.graphs = {}                          # eager: the profiler sees each launch
        runner.decode(seqs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.decode(seqs)
            torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
            and "memset" not in e.name.lower()]


def test_int8_decode_step_launches_no_more_kernels(smollm_random):
    """Quantising happens inside the rotary-and-write kernel: a decode step with the int8 cache
    runs as many kernels as with the bf16 cache."""
    bf16 = _decode_kernels(_runner(smollm_random, "auto", cuda_graphs=False))
    int8 = _decode_kernels(_runner(smollm_random, "int8", cuda_graphs=False))
    assert len(int8) == len(bf16), (f"int8 step {len(int8)} kernels, bf16 step {len(bf16)}; extra: "
                                    f"{sorted(set(int8) - set(bf16))[:10]}")
    assert any("split_kernel" in name and "signed char" in name for name in int8), "no int8 split kernel ran"


def test_int8_engine_teacher_forced_under_graphs_matches_eager_and_stays_close_to_bf16(smollm_random):
    from .test_engine_cuda import decode_continuation
    from server.engine.block_manager import BlockManager
    from server.engine.params import SamplingParams
    from server.engine.sequence import Sequence
    gen = torch.Generator().manual_seed(torch.seed())
    prompt = torch.randint(10, 40000, (300,), generator=gen).tolist()
    continuation = torch.randint(10, 40000, (64,), generator=gen).tolist()

    @torch.inference_mode()
    def run(kv, graphs):
        runner = _runner(smollm_random, kv, cuda_graphs=graphs)
        blocks = BlockManager(runner.num_blocks, runner.block_size)
        seq = Sequence("tf", prompt, SamplingParams(), seed=0)
        blocks.grow(seq.block_table, seq.length)
        return decode_continuation(runner, blocks, seq, runner.prefill([(seq, seq.length)])[0], continuation).double()

    graphs, eager, bf16 = run("int8", True), run("int8", False), run("auto", True)
    assert torch.isfinite(graphs).all()
    assert torch.equal(graphs, eager), (graphs - eager).abs().max()
    ref, ours = torch.log_softmax(bf16, -1), torch.log_softmax(graphs, -1)
    kl = (ref.exp() * (ref - ours)).sum(-1).mean().item()
    agree = (ref.argmax(-1) == ours.argmax(-1)).double().mean().item()
    # a random model's next-token distributions are near ties, so top-1 agreement is only reported
    assert kl <= 0.01, f"random smollm2-135m: mean KL {kl:.4g} nats, top-1 agreement {agree:.3f}"


def test_int8_engine_answers_paris():
    """The embedded SmolLM2-135M-Instruct in bf16 on the GPU with the int8 cache, greedy."""
    from load_tests.kv_accuracy import greedy_answer
    from models import load_model
    loaded = load_model("default", dtype="bfloat16", device="cuda")
    assert "Paris" in greedy_answer(loaded, "int8", max_new_tokens=12)
