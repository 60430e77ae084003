"""The int8 KV cache on the CPU: the row format (quantise/dequantise bounds, the scale's rounding),
the reference decode on int8 caches against float64 attention over the dequantised cache, the
quantising writes, the API's refusals, the engine's int8 pool, and fp8's start-up error."""

import pytest
import torch

import kernels
from kernels.kv_quant import (INT8, INT8_MAX, SCALE_DTYPE, SCALE_MAX, dequantize_rows, new_scales, quantize_rows,
                              quantize_rows_asymmetric, row_scales)
from kernels.reference import split_decode

from .test_reference_decode import dense_attention_f64


def paged_int8(k, v, block_size, generator):
    """Dense ``k/v [B, Hkv, M, D]`` paged (``kernels.pack_paged``) and stored as int8 rows:
    ``(k_cache, v_cache, k_scale, v_scale, block_table)``."""
    k_float, v_float, table = kernels.pack_paged(k, v, block_size, generator=generator)
    (k_cache, ks), (v_cache, vs) = quantize_rows(k_float), quantize_rows(v_float)
    return k_cache, v_cache, ks, vs, table


def int8_case(batch, num_kv_heads, group, head_dim, lens, block_size, q_dtype=torch.float32, seed=None):
    """Random q and dense K/V whose rows differ in magnitude by 100x; the paged caches hold their
    int8 rows; returns the dequantised dense K/V (what the oracle attends over) as well."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    max_len = max(lens)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=g).to(q_dtype)
    # rows of different magnitudes, so that a scale applied to the wrong row shows
    row_mag = torch.rand(batch, num_kv_heads, max_len, 1, generator=g) * 4 + 0.04
    k = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=g) * row_mag
    v = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=g) * row_mag.flip(2)
    k_cache, v_cache, ks, vs, table = paged_int8(k, v, block_size, g)
    k_deq = dequantize_rows(*quantize_rows(k), torch.float64)
    v_deq = dequantize_rows(*quantize_rows(v), torch.float64)
    return q, k_deq, v_deq, k_cache, v_cache, ks, vs, table, torch.tensor(lens, dtype=torch.int32)


def test_round_trip_is_within_half_a_step_of_each_row():
    g = torch.Generator().manual_seed(torch.seed())
    x = torch.randn(200, 3, 64, generator=g) * torch.rand(200, 3, 1, generator=g).pow(4) * 50
    x[0, 0] = 0.0                                               # a row of zeros
    x[1, 1, :] = 1e-6 * torch.randn(64, generator=g)            # a row whose scale is an fp16 subnormal
    codes, scales = quantize_rows(x)
    assert codes.dtype == INT8 and scales.dtype == SCALE_DTYPE and scales.shape == (200, 3)
    y = dequantize_rows(codes, scales, torch.float64)
    step = scales.double().unsqueeze(-1)
    assert bool(((y - x.double()).abs() <= step / 2 + 1e-12).all())
    amax = x.double().abs().amax(-1)
    assert bool((scales.double() * INT8_MAX >= amax).all())     # rounded up: nothing clips
    assert bool((scales.double() <= amax / INT8_MAX * (1 + 2 ** -10) + 2 ** -24).all())
    assert scales[0, 0].item() == 0.0 and bool((codes[0, 0] == 0).all())
    assert bool((codes.abs() <= 127).all()) and bool(torch.isfinite(y).all())
    # the row's largest element uses the whole range (scales are normal floats here)
    big = amax > 1e-2
    assert bool((codes.abs().amax(-1)[big] >= 126).all())


def test_scale_is_amax_over_127_rounded_up_to_float16_and_capped():
    x = torch.zeros(4, 8)
    x[1, 3] = -127.0                        # scale 1 exactly
    x[2, 0] = 1.0                           # 1/127 is no float16: the next float16 above it
    x[3, 5] = 1e6                           # past the cap: saturates at +-127 * SCALE_MAX
    s = row_scales(x)
    assert s[0].item() == 0.0 and s[1].item() == 1.0 and s[3].item() == SCALE_MAX
    step = 2.0 ** -17                       # float16's step in [2^-7, 2^-6), where 1/127 lies
    assert s[2].item() > 1 / 127 > s[2].item() - step and s[2].item() % step == 0
    codes, _ = quantize_rows(x)
    assert codes[3, 5].item() == 127 and codes[2, 0].item() == 127


def test_asymmetric_format_reads_back_within_a_step():
    g = torch.Generator().manual_seed(torch.seed())
    x = torch.randn(50, 2, 64, generator=g) + 3.0
    y = quantize_rows_asymmetric(x)
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 255
    assert bool(((y - x).abs() <= step * 0.51 + 2e-3).all())


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 5, 700])
def test_reference_on_int8_caches_matches_float64_over_the_dequantised_cache(head_dim, group, num_splits):
    lens = [1, 15, 16, 17, 700, 37]
    q, k, v, k_cache, v_cache, ks, vs, table, seq_lens = int8_case(len(lens), 2, group, head_dim, lens, 16)
    out = split_decode(q, k_cache, v_cache, table, seq_lens, num_splits, k_scale=ks, v_scale=vs)
    ref = dense_attention_f64(q, k, v, seq_lens, head_dim ** -0.5)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_reference_ignores_garbage_scales_of_unwritten_rows():
    """Rows past a sequence's end may hold anything, NaN scales included: masked, never read."""
    lens = [5, 40]
    q, k, v, k_cache, v_cache, ks, vs, table, seq_lens = int8_case(2, 2, 2, 64, lens, 16)
    for b, n in enumerate(lens):
        for pos in range(n, table.shape[1] * 16):
            blk = table[b, pos // 16]
            ks[blk, :, pos % 16] = float("nan")
            vs[blk, :, pos % 16] = float("nan")
    out = split_decode(q, k_cache, v_cache, table, seq_lens, 3, k_scale=ks, v_scale=vs)
    ref = dense_attention_f64(q, k, v, seq_lens, 64 ** -0.5)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_reference_with_bf16_queries_on_int8_caches():
    lens = [3, 300]
    q, k, v, k_cache, v_cache, ks, vs, table, seq_lens = int8_case(2, 3, 3, 64, lens, 16, q_dtype=torch.bfloat16)
    out = kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, k_scale=ks, v_scale=vs)
    ref = dense_attention_f64(q, k, v, seq_lens, 64 ** -0.5)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max().item() <= 2 ** -8 * ref.abs().max().item() + 1e-6


def test_flash_decode_refuses_missing_or_misshapen_scales():
    q, _, _, k_cache, v_cache, ks, vs, table, seq_lens = int8_case(1, 2, 2, 64, [20], 16)
    with pytest.raises(ValueError, match="k_scale.*v_scale"):
        kernels.flash_decode(q, k_cache, v_cache, table, seq_lens)
    with pytest.raises(ValueError, match="k_scale=.*v_scale=None"):
        kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, k_scale=ks)
    float_cache = dequantize_rows(k_cache, ks)
    with pytest.raises(ValueError, match="k_scale and v_scale are for int8 caches only"):
        kernels.flash_decode(q, float_cache, float_cache, table, seq_lens, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match=r"k_scale must be contiguous float16 .* = \[2, 2, 16\], got .*\[1, 2, 16\]"):
        kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, k_scale=ks[:1], v_scale=vs)
    with pytest.raises(ValueError, match=r"v_scale must be contiguous float16.*got torch.float32"):
        kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, k_scale=ks, v_scale=vs.float())


def test_write_kv_quantises_each_row_and_skips_padded_rows():
    g = torch.Generator().manual_seed(torch.seed())
    k_cache = torch.zeros(4, 2, 16, 64, dtype=INT8)
    v_cache = torch.zeros_like(k_cache)
    ks, vs = new_scales(k_cache), new_scales(v_cache)
    key = (torch.randn(6, 2, 64, generator=g) * 3).bfloat16()
    value = (torch.randn(6, 2, 64, generator=g) * 0.01).bfloat16()
    slots = torch.tensor([5, -1, 17, 63, -1, 0], dtype=torch.int32)
    kernels.write_kv(k_cache, v_cache, key, value, slots, ks, vs)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, 16)
        for cache, scales, x in ((k_cache, ks, key), (v_cache, vs, value)):
            codes, s = quantize_rows(x[t])
            assert torch.equal(cache[block, :, row], codes) and torch.equal(scales[block, :, row], s)
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(64) if s not in written]
    assert all(k_cache[s // 16, :, s % 16].eq(0).all() and ks[s // 16, :, s % 16].eq(0).all() for s in untouched)
    k, v = kernels.read_kv(k_cache, v_cache, slots, torch.float32, ks, vs)
    assert torch.equal(k[1], torch.zeros(2, 64)) and (k[0] - key[0].float()).abs().max() <= ks[0, :, 5].max()


def test_rope_write_kv_stores_the_rows_of_the_rounded_rotated_key():
    from kernels import layer_ops
    g = torch.Generator().manual_seed(torch.seed())
    hq, hkv, d, tokens = 4, 2, 64, 5
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).bfloat16()
    cos_sin = torch.randn(32, d, generator=g)
    positions = torch.randint(0, 32, (tokens,), generator=g, dtype=torch.int32)
    slots = torch.tensor([3, 9, -1, 30, 12], dtype=torch.int32)
    k8, v8 = torch.zeros(2, hkv, 16, d, dtype=INT8), torch.zeros(2, hkv, 16, d, dtype=INT8)
    ks, vs = new_scales(k8), new_scales(v8)
    kb, vb = torch.zeros(2, hkv, 16, d, dtype=torch.bfloat16), torch.zeros(2, hkv, 16, d, dtype=torch.bfloat16)
    rotated8, rotatedb = qkv.clone(), qkv.clone()
    layer_ops.rope_write_kv(rotated8, positions, cos_sin, k8, v8, slots, hq, k_scale=ks, v_scale=vs)
    layer_ops.rope_write_kv(rotatedb, positions, cos_sin, kb, vb, slots, hq)
    assert torch.equal(rotated8, rotatedb)
    for cache, scales, ref in ((k8, ks, kb), (v8, vs, vb)):
        codes, s = quantize_rows(ref)
        assert torch.equal(cache, codes) and torch.equal(scales, s)
    with pytest.raises(ValueError, match="k_scale.*v_scale"):
        layer_ops.rope_write_kv(rotated8, positions, cos_sin, k8, v8, slots, hq)


def test_cpu_split_kv_decode_on_int8_caches_matches_the_reference():
    from models.cpu_attention import DecodePlan, split_kv_decode
    lens = [1, 16, 33, 250]
    q, _, _, k_cache, v_cache, ks, vs, table, seq_lens = int8_case(len(lens), 3, 3, 64, lens, 16)
    plan = DecodePlan.make(table, seq_lens, torch.zeros(len(lens), dtype=torch.int32), 16)
    ours = split_kv_decode(q, k_cache, v_cache, plan, 0.125, ks, vs)
    ref = split_decode(q, k_cache, v_cache, table, seq_lens, 1, scale=0.125, k_scale=ks, v_scale=vs)
    assert (ours - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_cpu_write_new_kv_stores_rows_and_scales():
    from models.cpu_attention import DecodePlan, write_new_kv
    g = torch.Generator().manual_seed(torch.seed())
    k_cache = torch.zeros(6, 2, 16, 64, dtype=INT8)
    v_cache = torch.zeros_like(k_cache)
    ks, vs = new_scales(k_cache), new_scales(v_cache)
    for slots in ([37], [3, 40, 81]):
        lens = torch.tensor([s % 16 + 1 for s in slots], dtype=torch.int32)
        table = torch.tensor([[s // 16] for s in slots], dtype=torch.int32)
        plan = DecodePlan.make(table, lens, torch.tensor(slots, dtype=torch.int32), 16)
        key, value = torch.randn(len(slots), 2, 64, generator=g), torch.randn(len(slots), 2, 64, generator=g) * 5
        write_new_kv(k_cache, v_cache, key, value, plan, ks, vs)
        for i, s in enumerate(slots):
            for cache, scales, x in ((k_cache, ks, key), (v_cache, vs, value)):
                codes, sc = quantize_rows(x[i])
                assert torch.equal(cache[s // 16, :, s % 16], codes) and torch.equal(scales[s // 16, :, s % 16], sc)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("window", [1, 17, 100, 5000])
def test_windowed_reference_and_cpu_decode_on_int8_caches(head_dim, window):
    from models.cpu_attention import DecodePlan, split_kv_decode

    from .test_window import windowed_attention_f64
    lens = [1, 16, 33, 250, 701]
    q, k, v, k_cache, v_cache, ks, vs, table, seq_lens = int8_case(len(lens), 2, 3, head_dim, lens, 16)
    ref = windowed_attention_f64(q, k, v, seq_lens, 0.125, window)
    bound = 1e-5 * max(1.0, ref.abs().max().item())
    out = split_decode(q, k_cache, v_cache, table, seq_lens, 3, scale=0.125, window=window, k_scale=ks, v_scale=vs)
    assert (out.double() - ref).abs().max().item() <= bound
    plan = DecodePlan.make(table, seq_lens, torch.zeros(len(lens), dtype=torch.int32), 16, window)
    cpu = split_kv_decode(q, k_cache, v_cache, plan, 0.125, ks, vs)
    assert (cpu.double() - ref).abs().max().item() <= bound


def test_prefill_over_a_cached_prefix_dequantises():
    """A later prompt chunk attends over cached int8 rows as over a float cache of their values."""
    from models.attention import AttentionBatch, prefill_attention
    q, _, _, k_cache, v_cache, ks, vs, table, _ = int8_case(1, 2, 3, 64, [40], 16)
    context, n = 32, 8
    g = torch.Generator().manual_seed(torch.seed())
    qc = torch.randn(n, 6, 64, generator=g)
    kc, vc = torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g)
    batch = AttentionBatch([], None, table, torch.tensor([context + n], dtype=torch.int32), is_decode=False,
                           query_starts=[0, n], context_lens=[context])
    ours = prefill_attention(qc, kc, vc, 0.125, batch, k_cache, v_cache, ks, vs)
    floats = prefill_attention(qc, kc, vc, 0.125, batch, dequantize_rows(k_cache, ks), dequantize_rows(v_cache, vs))
    assert torch.allclose(ours, floats, atol=1e-6)


def test_an_int8_pool_holds_at_least_1_9x_the_bf16_tokens():
    from models.presets import preset_config
    from server.engine.model_runner import kv_bytes_per_block
    for preset in ("smollm2-135m", "gemma3-270m"):
        cfg = preset_config(preset)
        ratio = kv_bytes_per_block(cfg, 16, torch.bfloat16) / kv_bytes_per_block(cfg, 16, INT8)
        assert ratio >= 1.9, (preset, ratio)
    cfg = preset_config("smollm2-135m")      # head_dim 64: 128 bytes a row against 64 + 2
    assert kv_bytes_per_block(cfg, 16, torch.bfloat16) * 66 == kv_bytes_per_block(cfg, 16, INT8) * 128


def test_fp8_is_refused_at_start_up_naming_int8():
    from server.engine import EngineConfig
    with pytest.raises(ValueError, match="'fp8'.*removed.*use 'int8'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="not one of auto, int8"):
        EngineConfig(kv_cache_dtype="int4")


def test_cli_refuses_fp8_naming_int8(capsys):
    from server.cli import parse_args
    for argv, environ in ((["--kv-cache-dtype", "fp8"], {}), ([], {"FLASHDECODE_KV_CACHE_DTYPE": "fp8"})):
        with pytest.raises(SystemExit):
            parse_args(argv, environ)
        err = capsys.readouterr().err
        assert "'fp8' was removed" in err and "use int8" in err and "--kv-cache-dtype" in err
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "int4"], {})
    assert "choose from auto, int8, not 'int4'" in capsys.readouterr().err
    assert parse_args(["--kv-cache-dtype", "int8"], {}).kv_cache_dtype == "int8"


@pytest.fixture(scope="module")
def tiny():
    from models import load_model
    return load_model("random:tiny", dtype="float32", device="cpu")


def test_int8_engine_allocates_row_scales_and_generates_like_the_float_cache(tiny, caplog):
    from server.engine import EngineConfig, SamplingParams
    from server.engine.model_runner import ModelRunner
    from .helpers import tokens_under
    with caplog.at_level("INFO"):
        runner = ModelRunner(tiny, EngineConfig(max_batch=2, num_blocks=16, block_size=16, kv_cache_dtype="int8"),
                             max_model_len=256)
    assert all(k.dtype == INT8 and v.dtype == INT8 for k, v in runner.kv_caches)
    assert all(ks.shape == (16, k.shape[1], 16) and ks.dtype == SCALE_DTYPE
               for (k, _), (ks, _) in zip(runner.kv_caches, runner.kv_scales))
    assert "x the tokens of a float32 pool" in caplog.text
    prompts = [[9 + (i * 7 + j) % 4000 for j in range(n)] for i, n in enumerate([3, 40])]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    configs = [EngineConfig(max_batch=4, num_blocks=32, block_size=16, kv_cache_dtype=d) for d in ("auto", "int8")]
    float_tokens, int8_tokens = tokens_under(tiny, configs, [(p, params) for p in prompts])
    assert len(int8_tokens) == 2 and all(len(t) == 8 for t in int8_tokens)
    assert int8_tokens == float_tokens      # a random model's peaked logits: 8 greedy tokens agree


def test_int8_cache_under_the_fused_decoder_with_windows_head_dim_256_and_qk_norms():
    """Gemma 3's preset (sliding layers, head_dim 256, per-head q/k norms fused into the rotary
    write) on the CPU through FusedDecoder: an int8 cache's teacher-forced next-token
    distributions stay within 1e-3 nats (mean KL) of the float cache's, over a prompt longer
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
    for kv_dtype in ("auto", "int8"):
        runner = ModelRunner(loaded, EngineConfig(max_batch=2, num_blocks=80, block_size=16, cpu_weights="float",
                                                  kv_cache_dtype=kv_dtype), max_model_len=1024)
        assert isinstance(runner.forward, FusedDecoder)
        logits.append(runner_teacher_forced(runner, ids[:window + 90], ids[window + 90:]).log_softmax(-1))
    float_lp, int8_lp = logits
    kl = (float_lp.exp() * (float_lp - int8_lp)).sum(-1).mean().item()
    assert 0 < kl <= 1e-3


def test_int8_engine_answers_paris_with_the_embedded_model():
    """The embedded SmolLM2-135M-Instruct on the CPU with an int8 cache, greedy."""
    from load_tests.kv_accuracy import greedy_answer
    from models import load_model
    loaded = load_model("default", dtype="float32", device="cpu")
    assert "Paris" in greedy_answer(loaded, "int8", max_new_tokens=12)
