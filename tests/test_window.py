"""Sliding-window attention on the CPU: the reference decode, the workspace's per-window plans and
the prefill paths, each against a dense masked softmax in float64."""

import pytest
import torch

import kernels
from kernels import workspace as workspace_module
from kernels.planner import split_plan
from kernels.reference import split_decode
from models.attention import AttentionBatch, paged_attention, prefill_attention
from models.cpu_attention import DecodePlan, split_kv_decode


def windowed_attention_f64(q, k, v, seq_lens, scale, window):
    """q [B, Hq, D]; k, v [B, Hkv, M, D]: the last query of each sequence over positions
    ``seq_len - window <= p < seq_len`` (all when window is None), a dense masked softmax."""
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    out = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        kk = k[b, :, :n].double().repeat_interleave(group, dim=0)
        vv = v[b, :, :n].double().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[b].double() * scale, kk)
        if window is not None:
            scores[:, torch.arange(n) < n - window] = float("-inf")
        out[b] = torch.einsum("hn,hnd->hd", scores.softmax(-1), vv)
    return out


def make_case(lens, num_kv_heads, group, head_dim, block_size, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, longest = len(lens), max(lens)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=g, dtype=dtype)
    k = torch.randn(batch, num_kv_heads, longest, head_dim, generator=g, dtype=dtype)
    v = torch.randn(batch, num_kv_heads, longest, head_dim, generator=g, dtype=dtype)
    k_cache, v_cache, table = kernels.pack_paged(k, v, block_size, generator=g)
    return q, k, v, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


RAGGED = [1, 2, 15, 16, 17, 1000, 37, 513]
# smaller than every sequence, than some, not aligned to blocks of 16, one block, longer than all
WINDOWS = [1, 5, 16, 17, 100, 512, 999, 1000, 5000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_windowed_reference_matches_dense_masked_softmax(window, group, num_splits):
    q, k, v, k_cache, v_cache, table, lens = make_case(RAGGED, 2, group, 64, 16, seed=window * 31 + group)
    out = split_decode(q, k_cache, v_cache, table, lens, num_splits, window=window)
    exact = windowed_attention_f64(q, k, v, lens, 64 ** -0.5, window)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert (out.double() - exact).abs().max().item() <= 1e-5


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("window", [7, 300])
def test_windowed_reference_other_head_dims_and_blocks(head_dim, window):
    q, k, v, k_cache, v_cache, table, lens = make_case([299, 301, 40], 1, 4, head_dim, 32, seed=head_dim + window)
    out = kernels.flash_decode(q, k_cache, v_cache, table, lens, scale=0.07, window=window)
    assert (out.double() - windowed_attention_f64(q, k, v, lens, 0.07, window)).abs().max().item() <= 1e-5


def test_a_window_differs_from_global_attention():
    # Guards the oracle itself: a window shorter than the sequence must change the result.
    q, k, v, k_cache, v_cache, table, lens = make_case([200], 1, 2, 64, 16)
    windowed = split_decode(q, k_cache, v_cache, table, lens, 4, window=50)
    full = split_decode(q, k_cache, v_cache, table, lens, 4)
    assert (windowed - full).abs().max().item() > 1e-2


@pytest.mark.parametrize("window", [1, 20, 33])
def test_blocks_before_the_window_are_not_read(window):
    lens = [100, 64, 40]
    q, k, v, k_cache, v_cache, table, seq_lens = make_case(lens, 2, 3, 64, 16)
    exact = split_decode(q, k_cache, v_cache, table, seq_lens, 3, window=window)
    for b, n in enumerate(lens):
        first_block = max(0, n - window) // 16
        for j in range(first_block):
            k_cache[table[b, j]] = float("nan")
            v_cache[table[b, j]] = float("nan")
    poisoned = split_decode(q, k_cache, v_cache, table, seq_lens, 3, window=window)
    assert torch.equal(poisoned, exact)


def test_rows_past_the_end_may_hold_anything():
    lens = [30, 7, 64]
    q, k, v, k_cache, v_cache, table, seq_lens = make_case(lens, 2, 3, 64, 16)
    exact = windowed_attention_f64(q, k, v, seq_lens, 0.125, 10)
    for b, n in enumerate(lens):
        for t in range(n, table.shape[1] * 16):
            k_cache[table[b, t // 16], :, t % 16] = float("nan")
            v_cache[table[b, t // 16], :, t % 16] = float("nan")
    for window in (10, None):
        out = split_decode(q, k_cache, v_cache, table, seq_lens, 3, window=window)
        assert torch.isfinite(out).all(), f"window {window}"
    assert (split_decode(q, k_cache, v_cache, table, seq_lens, 3, window=10).double() - exact).abs().max() <= 1e-5


@pytest.mark.parametrize("window", [1, 5, 16, 17, 100, 999, 5000, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_engine_decode_plan_over_the_window(window, dtype):
    """The CPU engine's split-per-block decode (models/cpu_attention.py) with a window: against the
    dense masked softmax, and blind to the blocks before the window."""
    q, k, v, k_cache, v_cache, table, lens = make_case(RAGGED, 2, 3, 64, 16, dtype=dtype, seed=5)
    slots = torch.zeros(len(RAGGED), dtype=torch.int64)
    plan = DecodePlan.make(table, lens, slots, 16, window)
    out = split_kv_decode(q, k_cache, v_cache, plan, 0.125)
    assert (out.double() - windowed_attention_f64(q, k, v, lens, 0.125, window)).abs().max().item() <= 1e-5
    if window is not None:
        for b, n in enumerate(RAGGED):
            for j in range(max(0, n - window) // 16):
                k_cache[table[b, j]] = float("nan")
                v_cache[table[b, j]] = float("nan")
        assert torch.equal(split_kv_decode(q, k_cache, v_cache, plan, 0.125), out)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_invalid_windows_are_refused(bad):
    q, k, v, k_cache, v_cache, table, lens = make_case([10], 1, 1, 64, 16)
    with pytest.raises(ValueError, match="window must be a positive int or None"):
        kernels.flash_decode(q, k_cache, v_cache, table, lens, window=bad)
    with pytest.raises(ValueError, match="window must be a positive int"):
        kernels.Workspace(1, 1, 64, 64, "cpu", num_kv_heads=1, windows=(bad,))


def test_workspace_plans_each_window_over_its_span(monkeypatch):
    monkeypatch.setattr(workspace_module, "device_sm_count", lambda device: 132)
    ws = kernels.Workspace(64, 4, 256, 32768, "cpu", num_kv_heads=1, windows=(512, None, 512, 40000))
    assert ws.windows == (512,)                      # None and windows >= max_seq_len are global
    for batch in (1, 4, 64):
        assert ws.plan(batch, 512) == split_plan(batch, 4, 1, 256, 132, 512)
        assert ws.plan(batch) == split_plan(batch, 4, 1, 256, 132, 32768)
        assert ws.plan(batch, 32768) == ws.plan(batch, 10 ** 6) == ws.plan(batch)
        assert ws.capacity_rows >= batch * max(ws.num_splits(batch), ws.num_splits(batch, 512))
    assert ws.num_splits(1, 512) < ws.num_splits(1)  # a long global plan would waste splits on the window
    with pytest.raises(ValueError, match=r"planned for windows \[512\].*window 1024"):
        ws.plan(1, 1024)


def test_windowed_call_uses_its_plan_and_refuses_an_unplanned_window(monkeypatch):
    monkeypatch.setattr(workspace_module, "device_sm_count", lambda device: 132)
    ws = kernels.Workspace(2, 6, 64, 4096, "cpu", num_kv_heads=2, windows=(300,))
    q, k, v, k_cache, v_cache, table, lens = make_case([4096, 1000], 2, 3, 64, 32)
    used = []
    real = kernels.reference.split_decode
    monkeypatch.setattr(kernels.reference, "split_decode", lambda *a, **kw: used.append(a[5]) or real(*a, **kw))
    out = kernels.flash_decode(q, k_cache, v_cache, table, lens, workspace=ws, window=300)
    assert used == [ws.num_splits(2, 300)] and ws.num_splits(2, 300) != ws.num_splits(2)
    assert (out.double() - windowed_attention_f64(q, k, v, lens, 0.125, 300)).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="window 299"):
        kernels.flash_decode(q, k_cache, v_cache, table, lens, workspace=ws, window=299)


# ---- prefill ------------------------------------------------------------------------------------

def prefill_f64(q, k, v, scale, context, window):
    """q [n, Hq, D] at positions context..context+n-1 over k, v [context+n, Hkv, D]."""
    n, total = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.double().transpose(0, 1).repeat_interleave(group, dim=0) for t in (k, v))
    scores = (q.double().transpose(0, 1) @ kk.transpose(1, 2)) * scale          # [Hq, n, total]
    i = torch.arange(context, total).view(-1, 1)
    p = torch.arange(total).view(1, -1)
    seen = (p <= i) & ((p > i - window) if window is not None else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    return (scores.softmax(-1) @ vv).transpose(0, 1)


def prefill_case(contexts, takes, num_kv_heads=2, group=3, head_dim=64, block_size=16, seed=0):
    """Packed chunks after cached contexts: the caches hold every sequence's context and chunk."""
    g = torch.Generator().manual_seed(seed)
    totals = [c + t for c, t in zip(contexts, takes)]
    blocks_per_seq = -(-max(totals) // block_size)
    num_blocks = len(totals) * blocks_per_seq
    k_cache = torch.zeros(kernels.cache_shape(num_blocks, num_kv_heads, block_size, head_dim))
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(num_blocks, generator=g).view(len(totals), blocks_per_seq).to(torch.int32)
    keys, values, qs, starts = [], [], [], [0]
    key_slots, kv_starts = [], [0]
    for i, total in enumerate(totals):
        k = torch.randn(total, num_kv_heads, head_dim, generator=g)
        v = torch.randn(total, num_kv_heads, head_dim, generator=g)
        slots = table[i, torch.arange(total) // block_size].long() * block_size + torch.arange(total) % block_size
        kernels.write_kv(k_cache, v_cache, k, v, slots)
        keys.append(k)
        values.append(v)
        qs.append(torch.randn(takes[i], num_kv_heads * group, head_dim, generator=g))
        starts.append(starts[-1] + takes[i])
        key_slots.append(slots.int())
        kv_starts.append(kv_starts[-1] + total)
    q = torch.cat(qs)
    chunk_k = torch.cat([k[c:] for k, c in zip(keys, contexts)])
    chunk_v = torch.cat([v[c:] for v, c in zip(values, contexts)])
    batch = AttentionBatch([(k_cache, v_cache)], None, table, torch.tensor(totals, dtype=torch.int32),
                           is_decode=False, query_starts=starts, context_lens=list(contexts))
    gather = dict(key_slots=torch.cat(key_slots), kv_starts=kv_starts,
                  max_kv_len=max(totals))
    return q, chunk_k, chunk_v, keys, values, batch, gather, (k_cache, v_cache)


def exact_prefill(q, keys, values, batch, scale, window):
    return torch.cat([prefill_f64(q[a:b], keys[i], values[i], scale, batch.context_lens[i], window)
                      for i, (a, b) in enumerate(zip(batch.query_starts, batch.query_starts[1:]))])


@pytest.mark.parametrize("window", [None, 1, 7, 16, 45, 1000])
@pytest.mark.parametrize("contexts", [(0, 0, 0), (0, 37, 100)], ids=["whole prompts", "after a context"])
def test_prefill_honours_the_window(window, contexts):
    takes = (50, 1, 29)
    q, k, v, keys, values, batch, gather, (k_cache, v_cache) = prefill_case(contexts, takes, seed=7)
    exact = exact_prefill(q, keys, values, batch, 0.1, window)
    out = prefill_attention(q, k, v, 0.1, batch, k_cache, v_cache, window=window)
    assert (out.double() - exact).abs().max().item() <= 1e-5
    for name, value in gather.items():
        setattr(batch, name, value)
    gathered = prefill_attention(q, k, v, 0.1, batch, k_cache, v_cache, window=window)
    assert (gathered.double() - exact).abs().max().item() <= 1e-5


def test_prefill_refuses_an_invalid_window():
    q, k, v, keys, values, batch, gather, (k_cache, v_cache) = prefill_case((0,), (4,))
    with pytest.raises(ValueError, match="window must be a positive int"):
        prefill_attention(q, k, v, 0.1, batch, k_cache, v_cache, window=0)


# ---- the function transformers calls ------------------------------------------------------------

class SlidingLayer(torch.nn.Module):
    def __init__(self, sliding_window):
        super().__init__()
        self.layer_idx = 0
        self.sliding_window = sliding_window


@pytest.mark.parametrize("how", ["keyword", "module attribute"])
def test_paged_attention_passes_the_layers_window_on(how):
    window = 9
    lens = [40, 5, 23]
    q, k, v, k_cache, v_cache, table, seq_lens = make_case(lens, 2, 2, 64, 16, seed=3)
    # The decode step's new token is each sequence's last: rewrite it through paged_attention.
    last = torch.tensor(lens) - 1
    new_k, new_v = k[torch.arange(3), :, last], v[torch.arange(3), :, last]          # [B, Hkv, D]
    slots = (table[torch.arange(3), last // 16].long() * 16 + last % 16)
    batch = AttentionBatch([(k_cache, v_cache)], slots, table, seq_lens, is_decode=True)
    module = SlidingLayer(window if how == "module attribute" else None)
    kwargs = {"sliding_window": window} if how == "keyword" else {}
    out, _ = paged_attention(module, q.unsqueeze(2), new_k.unsqueeze(2), new_v.unsqueeze(2), None,
                             scaling=0.2, attn_batch=batch, **kwargs)
    exact = windowed_attention_f64(q, k, v, seq_lens, 0.2, window)
    assert out.shape == (3, 1, 4, 64)
    assert (out[:, 0].double() - exact).abs().max().item() <= 1e-5
    # A global layer (transformers passes sliding_window=None) attends to everything.
    out, _ = paged_attention(SlidingLayer(None), q.unsqueeze(2), new_k.unsqueeze(2), new_v.unsqueeze(2), None,
                             scaling=0.2, attn_batch=batch, sliding_window=None)
    assert (out[:, 0].double() - windowed_attention_f64(q, k, v, seq_lens, 0.2, None)).abs().max().item() <= 1e-5


# ---- transformers' own sliding layers --------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_sliding_layers_match_transformers(arch):
    """A small random model whose layers mix windows of 4 and global attention, run by its own
    transformers modules over our paged attention (prefill of 9 tokens, then 5 decode steps) and by
    transformers' eager attention with its sliding masks: the same logits at every position. This
    pins the window's convention (the query and the W - 1 positions before it) to transformers'."""
    import transformers
    from models import attention

    attention.register()
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if arch == "gemma3":
        config = transformers.Gemma3TextConfig(**common)
        cls = transformers.Gemma3ForCausalLM
    else:
        config = transformers.Qwen2Config(**common, use_sliding_window=True, max_window_layers=0)
        cls = transformers.Qwen2ForCausalLM
    assert attention.layer_windows(config) == [4, None, 4]
    torch.manual_seed(0)
    model = cls(config).eval()
    tokens = torch.randint(0, 64, (1, 14))
    with torch.no_grad():
        model.config._attn_implementation = "eager"
        expected = model(tokens, use_cache=False).logits[0]
        model.config._attn_implementation = attention.NAME
        block_size, prompt = 16, 9
        shape = kernels.cache_shape(2, 2, block_size, 16)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(3)]
        table = torch.tensor([[1, 0]], dtype=torch.int32)
        prefill = AttentionBatch(caches, torch.arange(block_size, block_size + prompt), table,
                                 torch.tensor([prompt], dtype=torch.int32), is_decode=False, query_starts=[0, prompt],
                                 context_lens=[0])
        got = [model(tokens[:, :prompt], position_ids=torch.arange(prompt).view(1, -1), use_cache=False,
                     attn_batch=prefill).logits[0]]
        for pos in range(prompt, tokens.shape[1]):
            step = AttentionBatch(caches, torch.tensor([block_size + pos]), table,
                                  torch.tensor([pos + 1], dtype=torch.int32), is_decode=True)
            got.append(model(tokens[:, pos:pos + 1], position_ids=torch.tensor([[pos]]), use_cache=False,
                             attn_batch=step).logits[0])
    got = torch.cat(got)
    assert (got - expected).abs().max().item() <= 1e-4
    # Guards the comparison: the windows change these logits (a global model would not match).
    model.config._attn_implementation = "eager"
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    model.config.layer_types = ["full_attention"] * 3
    with torch.no_grad():
        unwindowed = model(tokens, use_cache=False).logits[0]
    assert (unwindowed - expected).abs().max().item() > 1e-3
