"""kernels.read_kv on the CPU (the reference the GPU kernel is held to): rows read back at their
slots are the rows written there, int8 caches read as code * row scale, slot -1 reads zeros."""

import pytest
import torch

import kernels
from kernels.kv_quant import INT8, SCALE_DTYPE, dequantize_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_back_what_write_kv_stored_and_zeros_for_slot_minus_one_or_past_the_pool(dtype):
    g = torch.Generator().manual_seed(3)
    blocks, hkv, bs, d, tokens = 6, 2, 16, 8, 50
    k_cache = torch.randn(blocks, hkv, bs, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, hkv, bs, d, generator=g).to(dtype)
    key = torch.randn(tokens, hkv, d, generator=g).to(dtype)
    value = torch.randn(tokens, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens].int()
    kernels.write_kv(k_cache, v_cache, key, value, slots)
    read = slots.clone()
    read[::4] = -1
    read[1] = blocks * bs                                          # past the pool
    k, v = kernels.read_kv(k_cache, v_cache, read, dtype)
    kept = (read >= 0) & (read < blocks * bs)
    assert torch.equal(k[kept], key[kept]) and torch.equal(v[kept], value[kept])
    assert not k[~kept].any() and not v[~kept].any()


def test_int8_rows_read_as_code_times_row_scale():
    g = torch.Generator().manual_seed(5)
    k8, v8 = torch.randint(-127, 128, (2, 4, 2, 16, 8), dtype=INT8, generator=g).unbind(0)
    k_scale = (torch.rand(4, 2, 16, generator=g) * 0.5).to(SCALE_DTYPE)
    v_scale = (torch.rand(4, 2, 16, generator=g) * 30).to(SCALE_DTYPE)
    slots = torch.tensor([0, 17, 63, -1, 5], dtype=torch.int32)
    k, v = kernels.read_kv(k8, v8, slots, torch.bfloat16, k_scale, v_scale)
    blocks, rows = slots[:3].long() // 16, slots[:3].long() % 16
    assert torch.equal(k[:3], (k8[blocks, :, rows].float() * k_scale[blocks, :, rows].float().unsqueeze(-1)).bfloat16())
    assert torch.equal(v[:3], dequantize_rows(v8[blocks, :, rows], v_scale[blocks, :, rows], torch.bfloat16))
    assert not k[3].any() and not v[3].any()
    with pytest.raises(ValueError, match="int8 caches need k_scale and v_scale"):
        kernels.read_kv(k8, v8, slots, torch.bfloat16)


def test_a_16_bit_cache_reads_into_its_own_dtype_only():
    cache = torch.zeros(2, 1, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="torch.bfloat16 cache reads into torch.bfloat16, not torch.float32"):
        kernels.read_kv(cache, cache, torch.zeros(1, dtype=torch.int32), torch.float32)
