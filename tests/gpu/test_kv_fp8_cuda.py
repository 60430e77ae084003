"""The fp8 (float8_e4m3fn) KV cache on the GPU: the split kernel against a float64 oracle on the
dequantised cache, the quantising writes bit for bit against the reference quantisation, graph
replay, and the engine's decode step (kernel count, teacher-forced logits).

Criterion for attention (as in test_flash_decode_cuda.py): the kernel's max error against float64
attention over the dequantised cache (code * scale) is at most twice that of plain PyTorch
attention in q's precision over the same dequantised cache. Caches hold random codes at per-head
scales of different magnitudes; rows past each sequence's end and unused blocks hold the NaN code;
outputs and workspaces are poisoned with NaN before each call. Fresh random inputs every run (the
seed is in the test's user properties).
"""

import math

import pytest
import torch

import kernels
from kernels import layer_ops, ops
from kernels.kv_quant import FP8, dequantize, quantize, scales_from_amax
from kernels.paging import DEFAULT_BLOCK_SIZE

from .test_flash_decode_cuda import (BLOCK_SIZES, DEVICE, PLAN_CASES, REPLAY_CASES, assert_replay_equals_eager,  # noqa: F401
                                     fresh_seed, make_paged, new_decode_rows, oracle, plain_low_precision,
                                     poison)
from .test_layer_ops_cuda import rotary_table

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NAN_CODE = 0x7F


def fp8_paged(lengths, num_kv, head_dim, block_size, table_blocks=None, codes=None):
    """A paged fp8 cache of random values at per-head scales of different magnitudes (or of
    ``codes(shape)``, uint8, at scales of 2^7 times those), NaN codes past each end; returns it with its scales and the
    dequantised float32 cache (NaN past each end) that the oracle reads."""
    ref_k, ref_v, table, seq_lens = make_paged(lengths, num_kv, head_dim, block_size, torch.float32,
                                               table_blocks=table_blocks)
    invalid = torch.isnan(ref_k)
    out = []
    for cache in (ref_k, ref_v):
        mags = torch.rand(num_kv, device=DEVICE) * 3 + 0.05
        values = cache.nan_to_num(0.0) * mags.view(1, -1, 1, 1)
        if codes is None:
            scale = scales_from_amax(values.abs().amax(dim=(0, 2, 3)))
            fp8 = quantize(values, scale)
        else:                          # scales that make the given codes' values of order one
            scale = 2.0 ** 7 * mags
            fp8 = codes(cache.shape).view(FP8)
        fp8.view(torch.uint8).masked_fill_(invalid, NAN_CODE)
        deq = dequantize(fp8, scale)
        assert torch.isnan(deq[invalid]).all() and torch.isfinite(deq[~invalid]).all()
        out += [fp8, scale, deq]
    k8, ks, kd, v8, vs, vd = out
    return k8, v8, ks, vs, kd, vd, table, seq_lens


def assert_accurate(outs, q, k_deq, v_deq, table, seq_lens, scale, context="", window=None):
    """Finite, and the error against float64 attention over the dequantised cache (float32,
    NaN past each end) at most twice that of plain attention in q's dtype over it (over the last
    ``window`` positions where there is one)."""
    ref = oracle(q, k_deq, v_deq, table, seq_lens, scale, window)
    plain = plain_low_precision(q, k_deq.to(q.dtype), v_deq.to(q.dtype), table, seq_lens, scale, window)
    plain_err = (plain.double() - ref).abs().max().item()
    for out in outs:
        err = (out.double() - ref).abs().max().item()
        info = f"{context} err={err:.3g} plain={plain_err:.3g}"
        assert torch.isfinite(out).all(), "NaN/inf in output: " + info
        assert err <= 2 * plain_err + 1e-6, info


def check_fp8(lengths, num_q, num_kv, head_dim, block_size, dtype, workspace=None, seed=None, codes=None,
              window=None):
    table_blocks = None if workspace is None else -(-workspace.max_seq_len // block_size)
    k8, v8, ks, vs, kd, vd, table, seq_lens = fp8_paged(lengths, num_kv, head_dim, block_size, table_blocks, codes)
    batch = len(lengths)
    q = torch.randn(batch, num_q, head_dim, device=DEVICE, dtype=dtype)
    scale = head_dim ** -0.5
    if workspace is None:
        workspace = kernels.Workspace(batch, num_q, head_dim, table.shape[1] * block_size, DEVICE,
                                      num_kv_heads=num_kv, windows=(window,))
    poison(workspace, q.shape, dtype)
    out = kernels.flash_decode(q, k8, v8, table, seq_lens, scale=scale, workspace=workspace, window=window,
                               k_scale=ks, v_scale=vs)
    assert out.shape == q.shape and out.dtype == dtype
    # the oracle and the plain low-precision run (in q's dtype) read the dequantised cache
    assert_accurate([out], q, kd, vd, table, seq_lens, scale,
                    f"fp8 seed={seed} window={window} lengths={lengths[:8]}... plan={workspace.plan(batch, window)}",
                    window)
    return out


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", [1, 3, 4, 8, 12])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_matches_float64(dtype, head_dim, group, block_size, fresh_seed):
    num_kv = 2
    lengths = [1, 65, block_size - 1, block_size + 1] + torch.randint(1, 3000, (3,)).tolist()
    check_fp8(lengths, group * num_kv, num_kv, head_dim, block_size, dtype, seed=fresh_seed)


@pytest.mark.parametrize("window", [1, 17, 32, 512, 5000])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_sliding_window_matches_float64(dtype, head_dim, block_size, window, fresh_seed):
    """fp8 caches under a sliding window: at head_dim 256 V is read late, one 8-code group at a
    time; the window's masking and skipped blocks are the bf16 kernel's."""
    lengths = [1, 2, window, window + 1, 1000, 1025] + torch.randint(1, 3000, (3,)).tolist()
    check_fp8(lengths, 8, 2, head_dim, block_size, dtype, seed=fresh_seed, window=window)


@pytest.mark.parametrize("case", PLAN_CASES)
def test_fp8_every_launch_plan(case, fresh_seed):
    (num_q, num_kv, dim), batch, max_len = PLAN_CASES[case]
    lengths = ([max_len, 1, max(1, max_len // 3)] + torch.randint(1, max_len + 1, (batch,)).tolist())[:batch]
    ws = kernels.Workspace(batch, num_q, dim, max_len, DEVICE, num_kv_heads=num_kv)
    check_fp8(lengths, num_q, num_kv, dim, 32, torch.bfloat16, workspace=ws, seed=fresh_seed)


@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_fp8_ragged_batches(batch, fresh_seed):
    lengths = torch.randint(1, 2049, (batch,)).tolist()
    lengths[0] = 1
    check_fp8(lengths, 8, 2, 128, DEFAULT_BLOCK_SIZE, torch.bfloat16, seed=fresh_seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128)])
def test_fp8_long_sequences(shape, dtype, fresh_seed):
    num_q, num_kv, dim = shape
    check_fp8([131072, 77777], num_q, num_kv, dim, DEFAULT_BLOCK_SIZE, dtype, seed=fresh_seed)


@pytest.mark.parametrize("num_q,num_kv", [(20, 1), (64, 2)])
def test_fp8_groups_larger_than_one_block(num_q, num_kv, fresh_seed):
    check_fp8([5, 700, 3333], num_q, num_kv, 64, 64, torch.bfloat16, seed=fresh_seed)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_subnormal_codes_are_not_flushed(head_dim, fresh_seed):
    """Caches of subnormal codes only (|code| < 2^-6) at scales that make them the whole signal:
    a conversion that flushed them would give uniform attention over zero values."""
    def subnormal(shape):
        return (torch.randint(1, 8, shape, device=DEVICE) | (torch.randint(0, 2, shape, device=DEVICE) << 7)).to(torch.uint8)
    check_fp8([1, 300, 2000], 6, 2, head_dim, 32, torch.bfloat16, seed=fresh_seed, codes=subnormal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_every_code_dequantises_exactly(head_dim, dtype):
    """One cached token: the output is its V row, code * v_scale, exactly (a power-of-two scale
    keeps every product representable in q's dtype); the rows hold every finite code."""
    num_kv = 2
    finite = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    rows = -(-finite.numel() // head_dim)
    codes = torch.cat([finite, torch.zeros(rows * head_dim - finite.numel(), dtype=torch.uint8)]).view(rows, head_dim)
    k8 = torch.zeros(rows, num_kv, 16, head_dim, dtype=torch.uint8)
    k8[:, :, 0] = codes[:, None]
    v8 = k8.clone()
    k8, v8 = k8.view(FP8).to(DEVICE), v8.view(FP8).to(DEVICE)
    table = torch.arange(rows, dtype=torch.int32, device=DEVICE).view(rows, 1)
    seq_lens = torch.ones(rows, dtype=torch.int32, device=DEVICE)
    ks = torch.tensor([0.5, 2.0], device=DEVICE)
    vs = torch.tensor([2.0 ** -3, 2.0 ** 4], device=DEVICE)
    q = torch.randn(rows, num_kv * 3, head_dim, device=DEVICE, dtype=dtype)
    out = kernels.flash_decode(q, k8, v8, table, seq_lens, k_scale=ks, v_scale=vs)
    expected = dequantize(v8[:, :, 0], vs, torch.float64).repeat_interleave(3, dim=1).to(dtype)   # [rows, Hq, D]
    assert torch.equal(out, expected), (out - expected).abs().max()


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 2, 64)])
def test_fp8_three_blocks_per_sm_and_graph_replay(shape, fresh_seed):
    """The three-per-SM plan (rings of four 16 KB stages), eager against the oracle, then graph
    replay equal to eager."""
    num_q, num_kv, dim = shape
    batch = 3 * torch.cuda.get_device_properties(DEVICE).multi_processor_count // (2 * num_kv)
    lengths = [1, 130, 4096] + torch.randint(1, 4097, (batch - 3,)).tolist()
    k8, v8, ks, vs, kd, vd, table, seq_lens = fp8_paged(lengths, num_kv, dim, 32, table_blocks=4096 // 32)
    ws = kernels.Workspace(batch, num_q, dim, 4096, DEVICE, num_kv_heads=num_kv)
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
def test_fp8_graph_replay_with_the_quantising_write(case, fresh_seed):
    """A decode step's write_kv (quantising) then flash_decode, captured once and replayed over
    new inputs and new scales (copied into the captured scale tensors): replay equals eager."""
    (num_q, num_kv, dim), batch, max_len = PLAN_CASES[case]
    bs = 16
    k8, v8, ks, vs, _, _, table, seq_lens = fp8_paged([max_len] * batch, num_kv, dim, bs,
                                                      table_blocks=-(-max_len // bs))
    ws = kernels.Workspace(batch, num_q, dim, max_len, DEVICE, num_kv_heads=num_kv)
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
        value.copy_(torch.randn_like(value) * 5)
        ks.mul_(torch.rand_like(ks) + 0.5)
        vs.mul_(torch.rand_like(vs) + 0.5)

    assert_replay_equals_eager(step, [k8, v8], new_inputs, ws,
                               lambda out: assert_accurate([out], q, dequantize(k8, ks), dequantize(v8, vs), table,
                                                           seq_lens, dim ** -0.5))


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 128)])
def test_fp8_write_kv_is_bit_exact(dtype, head_dim, slot_dtype):
    """Codes equal to kernels.kv_quant.quantize on the CPU, saturation and subnormals included;
    padded rows (slot -1) and untouched rows keep their bytes."""
    tokens, hkv, bs, blocks = 300, 3, 16, 32
    scale_k = torch.rand(hkv, device=DEVICE) * 0.05 + 1e-3
    scale_v = torch.rand(hkv, device=DEVICE) * 0.05 + 1e-3
    # magnitudes from far below the smallest subnormal to far past 448 * scale
    mags = 10.0 ** torch.empty(tokens, hkv, 1, device=DEVICE).uniform_(-6, 2)
    key = (torch.randn(tokens, hkv, head_dim, device=DEVICE) * mags).to(dtype)
    value = (torch.randn(tokens, hkv, head_dim, device=DEVICE) * mags.flip(0)).to(dtype)
    slots = torch.randperm(blocks * bs, device=DEVICE)[:tokens].to(slot_dtype)
    slots[::7] = -1
    k8 = torch.full((blocks, hkv, bs, head_dim), 0x55, dtype=torch.uint8, device=DEVICE).view(FP8)
    v8 = k8.clone()
    kernels.write_kv(k8, v8, key, value, slots, scale_k, scale_v)
    k_ref = torch.full((blocks, hkv, bs, head_dim), 0x55, dtype=torch.uint8).view(FP8)
    v_ref = k_ref.clone()
    kernels.reference_write_kv(k_ref, v_ref, key.cpu(), value.cpu(), slots.cpu(), scale_k.cpu(), scale_v.cpu())
    for ours, ref, name in ((k8, k_ref, "k"), (v8, v_ref, "v")):
        diff = (ours.view(torch.uint8).cpu() != ref.view(torch.uint8)).sum().item()
        assert diff == 0, f"{name}: {diff} codes differ from kv_quant.quantize"
    assert (k8.view(torch.uint8) == 0x7E).any() and (k8.view(torch.uint8) == 0xFE).any()   # +-448 saturated
    assert ((k8.view(torch.uint8) & 0x78) == 0).logical_and(k8.view(torch.uint8) & 0x07 != 0).any()  # subnormals


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (4, 1, 256)])
def test_fp8_rope_write_kv_is_bit_exact(hq, hkv, d, qk_norm, dtype):
    """The rotary-and-write kernel with fp8 caches: q and k rotated in place as with a cache of
    q's dtype, and the cache holds the codes of the rounded rotated key and the value."""
    tokens, block_size, num_blocks, max_positions = 37, 16, 8, 4096
    table = rotary_table(max_positions, d).float().to(DEVICE)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=DEVICE, dtype=dtype) * 4
    positions = torch.randint(0, max_positions, (tokens,), device=DEVICE, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens].to(torch.int32)
    slots[::5] = -1
    ks = torch.rand(hkv, device=DEVICE) * 0.02 + 1e-3
    vs = torch.rand(hkv, device=DEVICE) * 0.02 + 1e-3
    shape = (num_blocks, hkv, block_size, d)
    k_plain = torch.zeros(shape, device=DEVICE, dtype=dtype)
    v_plain = torch.zeros_like(k_plain)
    k8 = torch.zeros(shape, device=DEVICE, dtype=FP8)
    v8 = torch.zeros_like(k8)
    # with per-head q/k norms (Qwen3, Gemma 3) the codes are those of the normalised, rotated key
    norms = {}
    if qk_norm:
        norms = dict(q_norm=torch.rand(d, device=DEVICE, dtype=dtype) + 0.5,
                     k_norm=torch.rand(d, device=DEVICE, dtype=dtype) + 0.5, eps=1e-6)
    plain, ours = qkv.clone(), qkv.clone()
    layer_ops.rope_write_kv(plain, positions, table, k_plain, v_plain, slots, hq, **norms)
    layer_ops.rope_write_kv(ours, positions, table, k8, v8, slots, hq, **norms, k_scale=ks, v_scale=vs)
    assert torch.equal(ours, plain)
    for codes, rounded, scale, name in ((k8, k_plain, ks, "k"), (v8, v_plain, vs, "v")):
        expected = quantize(rounded.cpu(), scale.cpu())
        diff = (codes.view(torch.uint8).cpu() != expected.view(torch.uint8)).sum().item()
        assert diff == 0, f"{name}: {diff} codes differ from kv_quant.quantize of the rounded rows"


def test_fp8_refusals_on_cuda():
    ops.load(DEVICE)                                  # the raw op below needs the library loaded
    k8, v8, ks, vs, _, _, table, seq_lens = fp8_paged([40], 2, 64, 16)
    q = torch.randn(1, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale.*v_scale"):
        kernels.flash_decode(q, k8, v8, table, seq_lens)
    with pytest.raises(ValueError, match="k_scale is on cpu"):
        kernels.flash_decode(q, k8, v8, table, seq_lens, k_scale=ks.cpu(), v_scale=vs)
    with pytest.raises(ValueError, match="k_scale and v_scale are for float8_e4m3fn caches only"):
        kernels.flash_decode(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), table, seq_lens, k_scale=ks, v_scale=vs)
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


def test_fp8_decode_step_launches_no_more_kernels(smollm_random):
    """Quantising happens inside the rotary-and-write kernel: a decode step with the fp8 cache
    runs as many kernels as with the bf16 cache."""
    bf16 = _decode_kernels(_runner(smollm_random, "auto", cuda_graphs=False))
    fp8 = _decode_kernels(_runner(smollm_random, "fp8", cuda_graphs=False))
    assert len(fp8) == len(bf16), (f"fp8 step {len(fp8)} kernels, bf16 step {len(bf16)}; extra: "
                                   f"{sorted(set(fp8) - set(bf16))[:10]}")
    assert any("fp8" in name for name in fp8), "no fp8 split kernel ran"


def test_fp8_engine_teacher_forced_under_graphs_matches_eager_and_stays_close_to_bf16(smollm_random):
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

    graphs, eager, bf16 = run("fp8", True), run("fp8", False), run("auto", True)
    assert torch.isfinite(graphs).all()
    assert torch.equal(graphs, eager), (graphs - eager).abs().max()
    ref, ours = torch.log_softmax(bf16, -1), torch.log_softmax(graphs, -1)
    kl = (ref.exp() * (ref - ours)).sum(-1).mean().item()
    agree = (ref.argmax(-1) == ours.argmax(-1)).double().mean().item()
    # a random model's next-token distributions are near ties, so top-1 agreement is only reported
    assert kl <= 0.01, f"random smollm2-135m: mean KL {kl:.4g} nats, top-1 agreement {agree:.3f}"
