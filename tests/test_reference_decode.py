"""The pure-PyTorch flash-decoding reference against a float64 dense softmax."""

import pytest
import torch

import kernels
from kernels.reference import merge_splits, split_attention, split_decode


def dense_attention_f64(q, k, v, seq_lens, scale):
    """q [B, Hq, D]; k, v [B, Hkv, M, D]; exact softmax attention per sequence in float64."""
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    out = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        kk = k[b, :, :n].double().repeat_interleave(group, dim=0)
        vv = v[b, :, :n].double().repeat_interleave(group, dim=0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[b].double() * scale, kk), dim=-1)
        out[b] = torch.einsum("hn,hnd->hd", p, vv)
    return out


def make_case(batch, num_kv_heads, group, head_dim, lens, block_size, dtype=torch.float32, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    max_len = max(lens)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=g, dtype=dtype)
    k = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=g, dtype=dtype)
    v = torch.randn(batch, num_kv_heads, max_len, head_dim, generator=g, dtype=dtype)
    k_cache, v_cache, table = kernels.pack_paged(k, v, block_size, generator=g)
    return q, k, v, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


BLOCK = 16
LENGTHS = [1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 1000]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("num_splits", [1, 5, 2000])
def test_reference_matches_float64(head_dim, group, length, num_splits):
    q, k, v, k_cache, v_cache, table, lens = make_case(2, 2, group, head_dim, [length, length], BLOCK)
    out = split_decode(q, k_cache, v_cache, table, lens, num_splits)
    ref = dense_attention_f64(q, k, v, lens, head_dim ** -0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("num_splits", [1, 3, 64, 1500])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_ragged_batch(num_splits, group):
    lens = [1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 1000, 37]
    q, k, v, k_cache, v_cache, table, seq_lens = make_case(len(lens), 3, group, 64, lens, BLOCK)
    out = split_decode(q, k_cache, v_cache, table, seq_lens, num_splits)
    ref = dense_attention_f64(q, k, v, seq_lens, 64 ** -0.5)
    assert (out.double() - ref).abs().max().item() <= 1e-5


def test_scale_and_default_plan():
    q, k, v, k_cache, v_cache, table, lens = make_case(3, 3, 3, 64, [5, 300, 77], 32)
    out = kernels.flash_decode(q, k_cache, v_cache, table, lens, scale=0.3)
    assert (out.double() - dense_attention_f64(q, k, v, lens, 0.3)).abs().max().item() <= 1e-5


def test_workspace_plan_is_used(monkeypatch):
    ws = kernels.Workspace(4, 9, 64, 4096, "cpu", num_kv_heads=3)
    q, k, v, k_cache, v_cache, table, lens = make_case(4, 3, 3, 64, [4096, 1, 17, 2048], 32)
    used = []
    real = kernels.reference.split_decode
    monkeypatch.setattr(kernels.reference, "split_decode", lambda *a, **kw: used.append(a[5]) or real(*a, **kw))
    out = kernels.flash_decode(q, k_cache, v_cache, table, lens, workspace=ws)
    assert used == [ws.num_splits(4)]
    assert (out.double() - dense_attention_f64(q, k, v, lens, 0.125)).abs().max().item() <= 1e-5


def test_workspace_requires_num_kv_heads():
    with pytest.raises(TypeError, match="num_kv_heads"):
        kernels.Workspace(4, 9, 64, 4096, "cpu")


# A call of 9 query heads over 3 KV heads, head_dim 64, a block table reaching 4096 tokens, and
# workspaces that differ from it in one value each.
MISFITS = {
    "num_kv_heads": (dict(num_q_heads=9, head_dim=64, max_seq_len=4096, num_kv_heads=9), "num_kv_heads 9.*num_kv_heads 3"),
    "num_q_heads": (dict(num_q_heads=6, head_dim=64, max_seq_len=4096, num_kv_heads=3), "num_q_heads 6.*num_q_heads 9"),
    "head_dim": (dict(num_q_heads=9, head_dim=128, max_seq_len=4096, num_kv_heads=3), "head_dim 128.*head_dim 64"),
    "longest sequence": (dict(num_q_heads=9, head_dim=64, max_seq_len=2048, num_kv_heads=3), "2048 tokens.*4096"),
}


@pytest.mark.parametrize("misfit", MISFITS)
def test_a_workspace_that_does_not_fit_the_call_is_refused(misfit):
    fields, message = MISFITS[misfit]
    ws = kernels.Workspace(4, device="cpu", **fields)
    q, k, v, k_cache, v_cache, table, lens = make_case(2, 3, 3, 64, [4096, 100], 32)
    with pytest.raises(ValueError, match=message):
        kernels.flash_decode(q, k_cache, v_cache, table, lens, workspace=ws)


def test_a_workspace_fits_a_table_rounded_up_to_whole_blocks():
    ws = kernels.Workspace(2, 9, 64, 1000, "cpu", num_kv_heads=3)   # 1000 tokens: 32 blocks of 32 reach 1024
    q, k, v, k_cache, v_cache, table, lens = make_case(2, 3, 3, 64, [1000, 5], 32)
    out = kernels.flash_decode(q, k_cache, v_cache, table, lens, workspace=ws)
    assert (out.double() - dense_attention_f64(q, k, v, lens, 0.125)).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="batch 3 outside"):
        kernels.flash_decode(*[torch.cat([t, t[:1]]) for t in (q,)], k_cache, v_cache,
                             torch.cat([table, table[:1]]), torch.cat([lens, lens[:1]]), workspace=ws)


def test_bf16_inputs_accumulate_in_fp32():
    q, k, v, k_cache, v_cache, table, lens = make_case(2, 2, 4, 128, [999, 1000], BLOCK, dtype=torch.bfloat16)
    out = split_decode(q, k_cache, v_cache, table, lens, 7)
    ref = dense_attention_f64(q, k, v, lens, 128 ** -0.5)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max().item() <= 2 ** -7   # one bf16 rounding of |out| < 1


def test_empty_splits_carry_minus_inf_and_merge_cleanly():
    q = torch.randn(1, 2, 64)
    k = torch.randn(1, 2, 3, 64)
    v = torch.randn(1, 2, 3, 64)
    o, lse = split_attention(q, k, v, torch.tensor([3]), num_splits=8)
    assert torch.isneginf(lse[..., 3:]).all() and torch.isfinite(lse[..., :3]).all()
    assert (o[:, :, 3:] == 0).all()
    merged = merge_splits(o, lse)
    assert torch.isfinite(merged).all()


def test_write_kv_skips_padded_slots():
    k_cache = torch.zeros(kernels.cache_shape(4, 2, 8, 64))
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.tensor([9, -1, 31], dtype=torch.int32)
    kernels.write_kv(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache[1, :, 1], key[0]) and torch.equal(v_cache[3, :, 7], value[2])
    written = (k_cache != 0).any(dim=-1).sum().item()
    assert written == 2 * 2                       # two tokens, two heads; the padded row wrote nothing


def test_pack_paged_round_trip():
    k, v = torch.randn(2, 3, 50, 64), torch.randn(2, 3, 50, 64)
    k_cache, v_cache, table = kernels.pack_paged(k, v, 16)
    dense = kernels.reference.gather_dense(k_cache, table, 50)
    assert torch.equal(dense, k)
    assert table.dtype == torch.int32 and table.shape == (2, 4)
