"""kernels.read_kv on the GPU: the key and value rows at their cache slots, the prefill after a
cached prefix's read of the paged cache. Bit for bit against the reference's indexing (a copy for
16-bit caches; code * row scale in float32, rounded once, for int8 caches); slot -1 reads zeros. The
output buffers come from the caching allocator, which is first handed memory full of NaN, so a
row the kernel skipped would show. Fresh random inputs every run."""

import pytest
import torch

import kernels
from kernels.kv_quant import INT8, SCALE_DTYPE

from .test_flash_decode_cuda import DEVICE, fresh_seed  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def poison_allocator(nbytes: int) -> None:
    """Leaves NaN in the memory the caching allocator hands out next (its cache emptied first, so
    no freed block of an earlier case, zeros in the right rows, is reused instead)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    torch.cuda.synchronize()


def random_slots(rows: int, num_slots: int) -> torch.Tensor:
    """Random slots, about one in ten -1 at random rows (the first row never, the last always
    when there are several), some read twice."""
    slots = torch.randint(0, num_slots, (rows,), device=DEVICE, dtype=torch.int32)
    unused = torch.rand(rows, device=DEVICE) < 0.1
    unused[0] = False
    if rows > 1:
        unused[-1] = True
    slots[unused] = -1
    slots[1::13] = slots[0::13][:slots[1::13].shape[0]]        # some rows read the same slot
    return slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("rows", [1, 777, 20_000])
def test_read_kv_is_the_rows_at_the_slots(dtype, head_dim, block_size, rows):
    hkv, blocks = 3, 40
    k_cache = torch.randn(blocks, hkv, block_size, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(blocks, hkv, block_size, head_dim, device=DEVICE).to(dtype)
    slots = random_slots(rows, blocks * block_size)
    poison_allocator(4 * rows * hkv * head_dim * 2)
    k, v = kernels.read_kv(k_cache, v_cache, slots, dtype)
    k_ref, v_ref = kernels.reference_read_kv(k_cache, v_cache, slots, dtype)
    assert k.shape == v.shape == (rows, hkv, head_dim) and k.dtype == v.dtype == dtype
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert not k[slots < 0].any() and not v[slots < 0].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_read_kv_dequantises_int8_codes_as_the_reference(dtype, head_dim):
    hkv, blocks, block_size, rows = 4, 24, 16, 3000
    codes = torch.randint(-127, 128, (2, blocks, hkv, block_size, head_dim), dtype=INT8, device=DEVICE)
    k8, v8 = codes.unbind(0)
    k_scale = (torch.rand(blocks, hkv, block_size, device=DEVICE) * 0.05 + 1e-3).to(SCALE_DTYPE)
    v_scale = (torch.rand(blocks, hkv, block_size, device=DEVICE) * 200 + 1e-3).to(SCALE_DTYPE)
    slots = random_slots(rows, blocks * block_size)
    poison_allocator(4 * rows * hkv * head_dim * 2)
    k, v = kernels.read_kv(k8, v8, slots, dtype, k_scale, v_scale)
    k_ref, v_ref = kernels.reference_read_kv(k8, v8, slots, dtype, k_scale, v_scale)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.isfinite(k).all() and torch.isfinite(v).all()


def test_read_kv_reads_back_what_write_kv_wrote():
    hkv, head_dim, block_size, blocks, tokens = 2, 64, 16, 8, 100
    k_cache = torch.zeros(blocks, hkv, block_size, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(tokens, hkv, head_dim, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(blocks * block_size, device=DEVICE)[:tokens].to(torch.int32)
    kernels.write_kv(k_cache, v_cache, key, value, slots)
    k, v = kernels.read_kv(k_cache, v_cache, slots, torch.bfloat16)
    assert torch.equal(k, key) and torch.equal(v, value)


def test_read_kv_captures_in_a_graph_and_replays_new_slots():
    hkv, head_dim, block_size, blocks, rows = 3, 64, 128, 16, 500
    k_cache = torch.randn(blocks, hkv, block_size, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    slots = random_slots(rows, blocks * block_size)
    kernels.read_kv(k_cache, v_cache, slots, torch.bfloat16)              # builds the op
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k, v = kernels.read_kv(k_cache, v_cache, slots, torch.bfloat16)
    slots.copy_(random_slots(rows, blocks * block_size))
    graph.replay()
    k_ref, v_ref = kernels.reference_read_kv(k_cache, v_cache, slots, torch.bfloat16)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_read_kv_refuses_what_it_cannot_serve():
    k_cache = torch.zeros(4, 2, 16, 64, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.zeros(3, device=DEVICE, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        kernels.read_kv(k_cache, k_cache.clone(), slots.long(), torch.bfloat16)
    with pytest.raises(ValueError, match="torch.bfloat16 cache reads into torch.bfloat16, not torch.float16"):
        kernels.read_kv(k_cache, k_cache.clone(), slots, torch.float16)
    with pytest.raises(ValueError, match="float32"):
        kernels.read_kv(k_cache.float(), k_cache.float(), slots, torch.float32)
