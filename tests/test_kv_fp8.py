"""The float8_e4m3fn KV cache on the CPU: quantisation, the reference decode on fp8 caches
against float64 attention over the dequantised cache, the quantising writes, the API's refusals,
and the engine's fp8 pool and scales."""

import json

import pytest
import torch

import kernels
from kernels import kv_quant
from kernels.kv_quant import FP8, FP8_MAX, dequantize, quantize, scales_from_amax
from kernels.reference import split_decode

from .test_reference_decode import dense_attention_f64


def fp8_case(batch, num_kv_heads, group, head_dim, lens, block_size, q_dtype=torch.float32, seed=None):
    """Random q and dense K/V; the paged caches hold their e4m3 codes at per-head scales; returns
    the dequantised dense K/V (what the oracle attends over) as well."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    max_len = max(lens)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=g).to(q_dtype)
    # heads of different magnitudes, so that a scale applied to the wrong head shows
    mags = torch.rand(num_kv_heads, generator=g) * 4 + 0.25
    k = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=g) * mags.view(1, -1, 1, 1)
    v = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=g) * mags.flip(0).view(1, -1, 1, 1)
    k_scale = scales_from_amax(k.abs().amax(dim=(0, 2, 3)))
    v_scale = scales_from_amax(v.abs().amax(dim=(0, 2, 3)))
    k_float, v_float, table = kernels.pack_paged(k, v, block_size, generator=g)
    k_cache, v_cache = quantize(k_float, k_scale), quantize(v_float, v_scale)
    k_deq = dequantize(quantize(k, k_scale), k_scale, torch.float64)
    v_deq = dequantize(quantize(v, v_scale), v_scale, torch.float64)
    return q, k_deq, v_deq, k_cache, v_cache, k_scale, v_scale, table, torch.tensor(lens, dtype=torch.int32)


def test_quantize_rounds_to_nearest_e4m3_and_saturates():
    g = torch.Generator().manual_seed(torch.seed())
    scale = torch.rand(3, generator=g) + 0.1
    x = torch.randn(50, 3, 64, generator=g) * 200 * scale.view(1, -1, 1)
    codes = quantize(x, scale)
    assert codes.dtype == FP8
    y = dequantize(codes, scale, torch.float64)
    scaled = x.double() / scale.double().view(1, -1, 1)
    inside = scaled.abs() <= FP8_MAX
    # e4m3 keeps 3 mantissa bits: a normal value is within 2^-4 relative, a subnormal within 2^-10 absolute
    err = (y / scale.double().view(1, -1, 1) - scaled).abs()
    bound = torch.maximum(scaled.abs() * 2 ** -4, torch.full_like(scaled, 2.0 ** -10))
    assert bool((err[inside] <= bound[inside]).all())
    saturated = dequantize(codes, scale, torch.float64)[~inside] / scale.double().view(1, -1, 1).expand_as(x)[~inside]
    assert saturated.numel() > 0 and bool((saturated.abs() == FP8_MAX).all())
    assert bool(torch.isfinite(y).all())


def test_scales_map_the_largest_magnitude_to_448():
    amax = torch.tensor([0.0, 1.5, 448.0])
    assert torch.equal(scales_from_amax(amax), torch.tensor([1 / 448, 1.5 / 448, 1.0]))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 5, 700])
def test_reference_on_fp8_caches_matches_float64_over_the_dequantised_cache(head_dim, group, num_splits):
    lens = [1, 15, 16, 17, 700, 37]
    q, k, v, k_cache, v_cache, ks, vs, table, seq_lens = fp8_case(len(lens), 2, group, head_dim, lens, 16)
    out = split_decode(q, k_cache, v_cache, table, seq_lens, num_splits, k_scale=ks, v_scale=vs)
    ref = dense_attention_f64(q, k, v, seq_lens, head_dim ** -0.5)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    # float32 rounding relative to the output: these heads' values reach |v| ~ 17, not 1
    assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_reference_with_bf16_queries_on_fp8_caches():
    lens = [3, 300]
    q, k, v, k_cache, v_cache, ks, vs, table, seq_lens = fp8_case(2, 3, 3, 64, lens, 16, q_dtype=torch.bfloat16)
    out = kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, k_scale=ks, v_scale=vs)
    ref = dense_attention_f64(q, k, v, seq_lens, 64 ** -0.5)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max().item() <= 2 ** -8 * ref.abs().max().item() + 1e-6


def test_flash_decode_refuses_missing_or_misplaced_scales():
    q, _, _, k_cache, v_cache, ks, vs, table, seq_lens = fp8_case(1, 2, 2, 64, [20], 16)
    with pytest.raises(ValueError, match="k_scale.*v_scale"):
        kernels.flash_decode(q, k_cache, v_cache, table, seq_lens)
    with pytest.raises(ValueError, match="k_scale=.*v_scale=None"):
        kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, k_scale=ks)
    float_cache = dequantize(k_cache, ks)
    with pytest.raises(ValueError, match="k_scale and v_scale are for float8_e4m3fn caches only"):
        kernels.flash_decode(q, float_cache, float_cache, table, seq_lens, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match=r"k_scale must be contiguous float32 \[num_kv_heads=2\]"):
        kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, k_scale=ks[:1], v_scale=vs)
    with pytest.raises(ValueError, match="v_scale must be contiguous float32"):
        kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, k_scale=ks, v_scale=vs.double())


def test_write_kv_quantises_and_skips_padded_rows():
    g = torch.Generator().manual_seed(torch.seed())
    k_cache = torch.zeros(4, 2, 16, 64, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    key = (torch.randn(6, 2, 64, generator=g) * 3).bfloat16()
    value = (torch.randn(6, 2, 64, generator=g) * 0.01).bfloat16()
    ks, vs = torch.tensor([0.01, 0.02]), torch.tensor([2e-5, 3e-5])
    slots = torch.tensor([5, -1, 17, 63, -1, 0], dtype=torch.int32)
    kernels.write_kv(k_cache, v_cache, key, value, slots, ks, vs)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, 16)
        assert torch.equal(k_cache[block, :, row].view(torch.uint8), quantize(key[t:t + 1], ks)[0].view(torch.uint8))
        assert torch.equal(v_cache[block, :, row].view(torch.uint8), quantize(value[t:t + 1], vs)[0].view(torch.uint8))
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(64) if s not in written]
    assert all(k_cache[s // 16, :, s % 16].view(torch.uint8).eq(0).all() for s in untouched)


def test_rope_write_kv_stores_the_codes_of_the_rounded_rotated_key():
    from kernels import layer_ops
    g = torch.Generator().manual_seed(torch.seed())
    hq, hkv, d, tokens = 4, 2, 64, 5
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).bfloat16()
    cos_sin = torch.randn(32, d, generator=g)
    positions = torch.randint(0, 32, (tokens,), generator=g, dtype=torch.int32)
    slots = torch.tensor([3, 9, -1, 30, 12], dtype=torch.int32)
    ks, vs = torch.tensor([0.02, 0.005]), torch.tensor([0.01, 0.03])
    k8, v8 = torch.zeros(2, hkv, 16, d, dtype=FP8), torch.zeros(2, hkv, 16, d, dtype=FP8)
    kb, vb = torch.zeros(2, hkv, 16, d, dtype=torch.bfloat16), torch.zeros(2, hkv, 16, d, dtype=torch.bfloat16)
    rotated8, rotatedb = qkv.clone(), qkv.clone()
    layer_ops.rope_write_kv(rotated8, positions, cos_sin, k8, v8, slots, hq, k_scale=ks, v_scale=vs)
    layer_ops.rope_write_kv(rotatedb, positions, cos_sin, kb, vb, slots, hq)
    assert torch.equal(rotated8, rotatedb)
    assert torch.equal(k8.view(torch.uint8), quantize(kb, ks).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), quantize(vb, vs).view(torch.uint8))
    with pytest.raises(ValueError, match="k_scale.*v_scale"):
        layer_ops.rope_write_kv(rotated8, positions, cos_sin, k8, v8, slots, hq)


def test_cpu_split_kv_decode_on_fp8_caches_matches_the_reference():
    from models.cpu_attention import DecodePlan, split_kv_decode
    lens = [1, 16, 33, 250]
    q, _, _, k_cache, v_cache, ks, vs, table, seq_lens = fp8_case(len(lens), 3, 3, 64, lens, 16)
    plan = DecodePlan.make(table, seq_lens, torch.zeros(len(lens), dtype=torch.int32), 16)
    ours = split_kv_decode(q, k_cache, v_cache, plan, 0.125, ks, vs)
    ref = split_decode(q, k_cache, v_cache, table, seq_lens, 1, scale=0.125, k_scale=ks, v_scale=vs)
    assert (ours - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("window", [1, 17, 100, 5000])
def test_windowed_reference_and_cpu_decode_on_fp8_caches(head_dim, window):
    """fp8 caches under a sliding window: the reference and the CPU engine's split-per-block decode
    against float64 over the dequantised window."""
    from models.cpu_attention import DecodePlan, split_kv_decode

    from .test_window import windowed_attention_f64
    lens = [1, 16, 33, 250, 701]
    q, k, v, k_cache, v_cache, ks, vs, table, seq_lens = fp8_case(len(lens), 2, 3, head_dim, lens, 16)
    ref = windowed_attention_f64(q, k, v, seq_lens, 0.125, window)
    bound = 1e-5 * max(1.0, ref.abs().max().item())
    out = split_decode(q, k_cache, v_cache, table, seq_lens, 3, scale=0.125, window=window, k_scale=ks, v_scale=vs)
    assert (out.double() - ref).abs().max().item() <= bound
    plan = DecodePlan.make(table, seq_lens, torch.zeros(len(lens), dtype=torch.int32), 16, window)
    cpu = split_kv_decode(q, k_cache, v_cache, plan, 0.125, ks, vs)
    assert (cpu.double() - ref).abs().max().item() <= bound


def test_prefill_over_a_cached_prefix_dequantises():
    """A later prompt chunk attends over cached fp8 rows as over a float cache of their values."""
    from models.attention import AttentionBatch, prefill_attention
    q, _, _, k_cache, v_cache, ks, vs, table, _ = fp8_case(1, 2, 3, 64, [40], 16)
    context, n = 32, 8
    g = torch.Generator().manual_seed(torch.seed())
    qc = torch.randn(n, 6, 64, generator=g)
    kc, vc = torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g)
    batch = AttentionBatch([], None, table, torch.tensor([context + n], dtype=torch.int32), is_decode=False,
                           query_starts=[0, n], context_lens=[context])
    ours = prefill_attention(qc, kc, vc, 0.125, batch, k_cache, v_cache, ks, vs)
    floats = prefill_attention(qc, kc, vc, 0.125, batch, dequantize(k_cache, ks), dequantize(v_cache, vs))
    assert torch.allclose(ours, floats, atol=1e-6)


def test_an_fp8_block_holds_half_the_bytes():
    from models.presets import preset_config
    from server.engine.model_runner import kv_bytes_per_block
    cfg = preset_config("smollm2-135m")
    assert kv_bytes_per_block(cfg, 16, torch.bfloat16) == 2 * kv_bytes_per_block(cfg, 16, FP8)


def test_engine_config_refuses_unknown_kv_dtypes_and_orphan_scales():
    from server.engine import EngineConfig
    with pytest.raises(ValueError, match="'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_scales_path.*'auto'"):
        EngineConfig(kv_scales_path="s.json")


def test_scales_file_round_trip_and_refusals(tmp_path):
    from server.engine.kv_scales import KvScales, load_scales
    scales = KvScales(torch.rand(3, 2) + 0.01, torch.rand(3, 2) + 0.01, "test")
    path = tmp_path / "s.json"
    path.write_text(scales.to_json())
    back = load_scales(path, 3, 2)
    assert torch.equal(back.k, scales.k) and torch.equal(back.v, scales.v)
    with pytest.raises(ValueError, match=r"k_scale is \[3, 2\] but the model has \[num_layers=4, num_kv_heads=2\]"):
        load_scales(path, 4, 2)
    path.write_text(json.dumps({"k_scale": [[1.0, 0.0]] * 3, "v_scale": [[1.0, 1.0]] * 3}))
    with pytest.raises(ValueError, match="positive and finite"):
        load_scales(path, 3, 2)


@pytest.fixture(scope="module")
def tiny():
    from models import load_model
    return load_model("random:tiny", dtype="float32", device="cpu")


def test_fp8_engine_calibrates_scales_and_generates_like_the_float_cache(tiny, tmp_path):
    from server.engine import EngineConfig, SamplingParams
    from server.engine.model_runner import ModelRunner
    from .helpers import tokens_under
    runner = ModelRunner(tiny, EngineConfig(max_batch=2, num_blocks=16, block_size=16, kv_cache_dtype="fp8"),
                         max_model_len=256)
    assert all(k.dtype == FP8 and v.dtype == FP8 for k, v in runner.kv_caches)
    assert runner.scales.k.shape == (2, 2) and bool((runner.scales.k > 0).all()) and bool((runner.scales.v > 0).all())
    assert "calibrated on" in runner.scales.describe()
    path = tmp_path / "scales.json"
    path.write_text(runner.scales.to_json())
    from_file = ModelRunner(tiny, EngineConfig(max_batch=2, num_blocks=16, block_size=16, kv_cache_dtype="fp8",
                                               kv_scales_path=str(path)), max_model_len=256)
    assert torch.equal(from_file.kv_scales[1][0], runner.kv_scales[1][0])
    prompts = [[9 + (i * 7 + j) % 4000 for j in range(n)] for i, n in enumerate([3, 40])]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    configs = [EngineConfig(max_batch=4, num_blocks=32, block_size=16, kv_cache_dtype=d) for d in ("auto", "fp8")]
    float_tokens, fp8_tokens = tokens_under(tiny, configs, [(p, params) for p in prompts])
    assert len(fp8_tokens) == 2 and all(len(t) == 8 for t in fp8_tokens)
    assert fp8_tokens == float_tokens      # a random model's peaked logits: 8 greedy tokens agree


def test_fp8_cache_under_the_fused_decoder_with_windows_head_dim_256_and_qk_norms():
    """Gemma 3's preset (sliding layers, head_dim 256, per-head q/k norms fused into the rotary
    write) on the CPU through FusedDecoder: an fp8 cache's teacher-forced next-token distributions
    stay within the fp8 target (mean KL <= 0.01 nats) of the float cache's, over a prompt longer
    than the window."""
    from models import FusedDecoder, load_model
    from server.engine import EngineConfig
    from server.engine.model_runner import ModelRunner

    from .helpers import perturb_small_tensors, runner_teacher_forced
    loaded = load_model("random:gemma3-270m@6", dtype="float32", device="cpu")
    perturb_small_tensors(loaded.model, seed=1)
    window = loaded.model.config.sliding_window
    ids = torch.randint(10, 49000, (window + 100,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = []
    for kv_dtype in ("auto", "fp8"):
        runner = ModelRunner(loaded, EngineConfig(max_batch=2, num_blocks=80, block_size=16, cpu_weights="float",
                                                  kv_cache_dtype=kv_dtype), max_model_len=1024)
        assert isinstance(runner.forward, FusedDecoder)
        logits.append(runner_teacher_forced(runner, ids[:window + 90], ids[window + 90:]).log_softmax(-1))
    float_lp, fp8_lp = logits
    assert (float_lp.exp() * (float_lp - fp8_lp)).sum(-1).mean().item() <= 0.01


def test_the_engine_refuses_fp8_where_the_cuda_kernel_reads_it_slower_than_bf16():
    from server.engine.model_runner import check_fp8_serves
    with pytest.raises(ValueError, match="head_dim 256"):
        check_fp8_serves(torch.device("cuda"), 256)
    check_fp8_serves(torch.device("cuda"), 128)
    check_fp8_serves(torch.device("cuda"), 64)
    check_fp8_serves(torch.device("cpu"), 256)          # the CPU reference has no such slow path
