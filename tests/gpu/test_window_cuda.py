"""Sliding-window decode and prefill on the GPU against float64 (GPU only).

The criterion is test_flash_decode_cuda's: error against the float64 oracle over the window at most
twice plain low-precision attention's over the same window, never NaN; cache rows past each
sequence's end and unused blocks hold NaN, outputs and workspaces are poisoned before each call.
A window W attends to positions ``seq_len - W .. seq_len - 1``; cache blocks wholly before them
must not be read (poisoned with NaN, the output must be finite and bit for bit the same).
"""

import pytest
import torch

import kernels
from kernels.planner import split_plan
from models.attention import prefill_attention
from tests.gpu.test_flash_decode_cuda import (DEVICE, assert_accurate, capture, check_against_oracle,  # noqa: F401
                                              fresh_seed, make_paged, poison)
from tests.test_window import exact_prefill, prefill_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# smaller than every sequence, unaligned to blocks and tiles, one tile at head_dim 256, one
# block of 128, between the lengths, longer than all
WINDOWS = [1, 17, 32, 100, 512, 1000, 5000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("group", [1, 4, 12])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_matches_float64(dtype, head_dim, group, block_size, window, fresh_seed):
    num_kv = 2
    lengths = [1, 2, window, window + 1, 999, 1000, 1025] + torch.randint(1, 3000, (3,)).tolist()
    check_against_oracle(lengths, group * num_kv, num_kv, head_dim, block_size, dtype, seed=fresh_seed, window=window)


# (Hq, Hkv, D), B, the workspace's longest sequence, the window: plans of one split to 128, the
# cluster merge and the merge kernel, over the window's span rather than the sequence's.
WINDOW_PLANS = {
    "Gemma-3-270M, B=1, window 512 at 32k": ((4, 1, 256), 1, 32768, 512),
    "Gemma-3-270M, B=64, window 512 at 4k": ((4, 1, 256), 64, 4096, 512),
    "9/3/64, B=8, window 4096 at 32k": ((9, 3, 64), 8, 32768, 4096),
    "32/8/128, B=1, window 1000 at 32k": ((32, 8, 128), 1, 32768, 1000),
    "8/1/128, B=1, window 20000 at 32k": ((8, 1, 128), 1, 32768, 20000),
}


@pytest.mark.parametrize("case", WINDOW_PLANS)
def test_windowed_plans(case, fresh_seed):
    (num_q, num_kv, dim), batch, max_len, window = WINDOW_PLANS[case]
    ws = kernels.Workspace(batch, num_q, dim, max_len, DEVICE, num_kv_heads=num_kv, windows=(window,))
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert ws.plan(batch, window) == split_plan(batch, num_q, num_kv, dim, sms, window), "planned over the window"
    lengths = ([max_len, 1, window - 1, window + 1] + torch.randint(1, max_len + 1, (batch,)).tolist())[:batch]
    check_against_oracle(lengths, num_q, num_kv, dim, 32, torch.bfloat16, workspace=ws, seed=fresh_seed,
                         window=window)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 128, 256])
@pytest.mark.parametrize("window", [1, 37, 300, 1000])
def test_blocks_before_the_window_are_not_read(head_dim, block_size, window):
    lengths = [5000, 1234, 40, 301]
    num_q, num_kv = 8, 2
    k_cache, v_cache, table, seq_lens = make_paged(lengths, num_kv, head_dim, block_size, torch.bfloat16)
    q = torch.randn(len(lengths), num_q, head_dim, device=DEVICE, dtype=torch.bfloat16)
    ws = kernels.Workspace(len(lengths), num_q, head_dim, table.shape[1] * block_size, DEVICE, num_kv_heads=num_kv,
                           windows=(window,))
    poison(ws, q.shape, q.dtype)
    clean = kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, workspace=ws, window=window)
    assert_accurate([clean], q, k_cache, v_cache, table, seq_lens, head_dim ** -0.5, f"window={window}", window)
    poisoned = 0
    for b, n in enumerate(lengths):
        for j in range(max(0, n - window) // block_size):   # blocks wholly before position n - window
            k_cache[table[b, j]] = float("nan")
            v_cache[table[b, j]] = float("nan")
            poisoned += 1
    assert poisoned > 0 or window >= max(lengths)
    poison(ws, q.shape, q.dtype)
    again = kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, workspace=ws, window=window)
    assert torch.isfinite(again).all(), f"a block wholly before the window was read ({poisoned} poisoned)"
    assert torch.equal(again, clean)


def test_mixed_windows_under_graph_replay():
    """Gemma 3's layout: five layers of window 512 to one global, all on one workspace, captured
    in one CUDA graph and replayed with new lengths; replay equals eager and the oracle."""
    num_q, num_kv, dim, bs, batch, max_len = 4, 1, 256, 32, 6, 4096
    windows = [512, 512, 512, 512, 512, None]
    layers = [make_paged([max_len] * batch, num_kv, dim, bs, torch.bfloat16, table_blocks=max_len // bs)
              for _ in windows]
    seq_lens = layers[0][3]                      # one batch: every layer's lengths
    ws = kernels.Workspace(batch, num_q, dim, max_len, DEVICE, num_kv_heads=num_kv, windows=(512,))
    q = torch.randn(batch, num_q, dim, device=DEVICE, dtype=torch.bfloat16)

    def step():
        return [kernels.flash_decode(q, kc, vc, table, seq_lens, workspace=ws, window=w)
                for (kc, vc, table, _), w in zip(layers, windows)]

    graph, static_outs = capture(step)
    for _ in range(3):
        lens = torch.randint(1, max_len + 1, (batch,), dtype=torch.int32)
        lens[0], lens[1] = 1, 513
        seq_lens.copy_(lens)
        q.copy_(torch.randn_like(q))
        for out in static_outs:
            out.fill_(float("nan"))
        ws.partial_out.fill_(float("nan"))
        graph.replay()
        replayed = [out.clone() for out in static_outs]
        eager = step()
        for i, ((kc, vc, table, _), w) in enumerate(zip(layers, windows)):
            assert torch.equal(replayed[i], eager[i]), f"layer {i} (window {w}): replay differs from eager"
            assert_accurate([replayed[i]], q, kc, vc, table, seq_lens, dim ** -0.5, f"layer {i} window {w}", w)


def test_window_refusals_and_the_default_workspace():
    k_cache, v_cache, table, seq_lens = make_paged([10, 2000], 1, 256, 32, torch.bfloat16)
    q = torch.randn(2, 4, 256, device=DEVICE, dtype=torch.bfloat16)
    ws = kernels.Workspace(2, 4, 256, table.shape[1] * 32, DEVICE, num_kv_heads=1, windows=(512,))
    with pytest.raises(ValueError, match=r"planned for windows \[512\].*window 300"):
        kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, workspace=ws, window=300)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="window must be a positive int"):
            kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, workspace=ws, window=bad)
    # Without a workspace the default one grows a plan for each new window.
    for window in (300, 512, None):
        out = kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, window=window)
        explicit = kernels.Workspace(2, 4, 256, table.shape[1] * 32, DEVICE, num_kv_heads=1, windows=(window,))
        assert torch.equal(out, kernels.flash_decode(q, k_cache, v_cache, table, seq_lens, workspace=explicit,
                                                     window=window))
        assert_accurate([out], q, k_cache, v_cache, table, seq_lens, 256 ** -0.5, f"window={window}", window)


# ---- prefill ------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("window", [None, 1, 7, 45, 1000])
@pytest.mark.parametrize("contexts", [(0, 0, 0), (0, 37, 100)],
                         ids=["whole prompts: varlen", "after a context: key_slots"])
def test_gpu_prefill_honours_the_window(contexts, window, head_dim):
    """FlashAttention's varlen call with window_size_left = W - 1 (whole prompts, and chunks over
    key rows gathered from the cache) against a dense masked float64 softmax; the bound is twice
    the error of the looped SDPA path with the mask built explicitly, in the same bf16."""
    takes = (50, 1, 29)
    q, k, v, keys, values, batch, gather, (k_cache, v_cache) = prefill_case(contexts, takes, head_dim=head_dim,
                                                                            seed=11)
    exact = exact_prefill(q, keys, values, batch, head_dim ** -0.5, window).to(DEVICE)
    to_gpu = lambda t: t.to(DEVICE, torch.bfloat16)
    q, k, v, k_cache, v_cache = map(to_gpu, (q, k, v, k_cache, v_cache))
    batch.block_tables = batch.block_tables.to(DEVICE)
    looped = prefill_attention(q, k, v, head_dim ** -0.5, batch, k_cache, v_cache, window=window)
    looped_err = (looped.double() - exact).abs().max().item()
    assert looped_err < 5e-2, f"the looped SDPA path is off: {looped_err:.3g}"   # bf16 rounding: ~1.2e-2 on the CPU
    starts = torch.tensor(batch.query_starts, dtype=torch.int32, device=DEVICE)
    batch.cu_query_starts, batch.max_query_len = starts, max(takes)
    if any(contexts):
        batch.key_slots = gather["key_slots"].to(DEVICE)
        batch.cu_kv_starts = torch.tensor(gather["kv_starts"], dtype=torch.int32, device=DEVICE)
        batch.kv_starts, batch.max_kv_len = gather["kv_starts"], gather["max_kv_len"]
    varlen = prefill_attention(q, k, v, head_dim ** -0.5, batch, k_cache, v_cache, window=window)
    varlen_err = (varlen.double() - exact).abs().max().item()
    assert torch.isfinite(varlen).all()
    assert varlen_err <= 2 * looped_err + 1e-3, f"window={window}: varlen {varlen_err:.3g}, looped {looped_err:.3g}"
