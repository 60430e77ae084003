"""The per-layer CUDA ops (RMSNorm with Llama's and Gemma's rounding, add + RMSNorm, the gated
activations, rotary embedding with the per-head q/k norms and the KV-cache write, the GEMV with
its bias, its residual add and RMSNorm in front and its gated epilogue) against float64 (GPU only).

Criterion as for attention: the kernel's max error against float64 is at most twice that of the
same computation done by PyTorch in the low precision (plus one ulp of slack for the final
rounding); outputs are poisoned with NaN first; inputs are fresh random each run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import layer_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SEED = int.from_bytes(os.urandom(4), "little")
DEVICE = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def fresh_seed(request):
    seed = (SEED + hash(request.node.name)) % 2**31
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))


def ulp(dtype, magnitude):
    return torch.finfo(dtype).eps * magnitude


def check(ours, theirs, exact, dtype):
    assert torch.isfinite(ours).all()
    our_err = (ours.double() - exact).abs().max().item()
    their_err = (theirs.double() - exact).abs().max().item()
    assert our_err <= 2 * their_err + ulp(dtype, exact.abs().max().item()), (our_err, their_err)


def rms_norm64(x, weight, eps):
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 576), (256, 576), (3, 4096), (33, 8192)])
def test_rms_norm(rows, hidden, dtype):
    x = torch.randn(rows, hidden, device=DEVICE, dtype=dtype) * 3
    weight = torch.randn(hidden, device=DEVICE, dtype=dtype)
    ours = layer_ops.rms_norm(x, weight, 1e-5)
    theirs = layer_ops._rms_norm_torch(x, weight, 1e-5)
    check(ours, theirs, rms_norm64(x, weight, 1e-5), dtype)


def poison_allocations(*shapes, dtype):
    """Leaves NaN in the caching allocator's free blocks of these shapes, so that an op's freshly
    allocated output that a kernel fails to fill shows NaN."""
    for shape in shapes:
        torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (64, 576), (5, 4096)])
def test_add_rms_norm_returns_the_norm_and_the_sum(rows, hidden, dtype):
    x = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
    residual = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
    weight = torch.randn(hidden, device=DEVICE, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    exact = rms_norm64(residual.double() + x.double(), weight, 1e-6)
    their_residual = residual + x
    theirs = layer_ops._rms_norm_torch(their_residual, weight, 1e-6)
    poison_allocations((rows, hidden), (rows, hidden), dtype=dtype)
    ours, summed = layer_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, their_residual)            # one rounding of the sum, as PyTorch's
    check(ours, theirs, exact, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (100, 1536), (3, 14336)])
def test_silu_and_mul(rows, inter, dtype):
    x = torch.randn(rows, 2 * inter, device=DEVICE, dtype=dtype) * 4
    gate, up = x.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    check(layer_ops.silu_and_mul(x), layer_ops.silu_and_mul(x.cpu()).to(DEVICE), exact, dtype)


def rotary_table(max_positions, head_dim):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (4, 4, 64)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_rope_write_kv(hq, hkv, d, dtype, slot_dtype):
    tokens, block_size, num_blocks, max_positions = 37, 16, 8, 4096
    table64 = rotary_table(max_positions, d)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=DEVICE, dtype=dtype)
    positions = torch.randint(0, max_positions, (tokens,), device=DEVICE, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens].to(slot_dtype)
    slots[::5] = -1                                       # padding rows write nothing
    k_cache = torch.full((num_blocks, hkv, block_size, d), float("nan"), device=DEVICE, dtype=dtype)
    v_cache = k_cache.clone()

    heads = qkv.double().unflatten(1, (-1, d))
    cs = table64.to(DEVICE)[positions.long()].unsqueeze(1)
    half = d // 2
    x1, x2 = heads[:, :hq + hkv, :half], heads[:, :hq + hkv, half:]
    exact = torch.cat([x1 * cs[..., :half] - x2 * cs[..., half:], x2 * cs[..., :half] + x1 * cs[..., half:]], -1)

    # PyTorch in the low precision, as transformers' apply_rotary_pos_emb does it
    low = qkv.unflatten(1, (-1, d))[:, :hq + hkv]
    cos = cs[..., :half].repeat(1, 1, 2).to(dtype)
    sin = cs[..., half:].repeat(1, 1, 2).to(dtype)
    theirs = low * cos + torch.cat([-low[..., half:], low[..., :half]], dim=-1) * sin

    ours = qkv.clone()
    layer_ops.rope_write_kv(ours, positions, table64.float().to(DEVICE), k_cache, v_cache, slots, hq)
    ours_heads = ours.unflatten(1, (-1, d))
    check(ours_heads[:, :hq + hkv], theirs, exact, dtype)
    assert torch.equal(ours_heads[:, hq + hkv:], qkv.unflatten(1, (-1, d))[:, hq + hkv:])   # values untouched

    written = slots >= 0
    s = slots[written].long()
    blocks, rows = s // block_size, s % block_size
    assert torch.equal(k_cache[blocks, :, rows], ours_heads[written, hq:hq + hkv])
    assert torch.equal(v_cache[blocks, :, rows], ours_heads[written, hq + hkv:])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[s] = False
    for cache in (k_cache, v_cache):
        assert torch.isnan(cache.transpose(1, 2).reshape(-1, hkv, d)[untouched]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (6144, 4096), (2048, 8192), (100, 40)])
def test_gemv(rows, n, k, dtype):
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
    w = torch.randn(n, k, device=DEVICE, dtype=dtype) / k ** 0.5
    exact = x.double() @ w.double().T
    poison_allocations((rows, n), dtype=dtype)
    ours = torch.ops.flashdecode.gemv(x, w)
    check(ours, torch.nn.functional.linear(x, w), exact, dtype)
    if layer_ops.gemv_serves(x, w):
        assert torch.equal(layer_ops.linear(x, w), ours)    # the entry point takes the GEMV here


def gelu_tanh64(x):
    return 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 2048), (100, 2048), (3, 6912)])
def test_gelu_tanh_and_mul(rows, inter, dtype):
    x = torch.randn(rows, 2 * inter, device=DEVICE, dtype=dtype) * 4
    gate, up = x.double().chunk(2, dim=-1)
    ours = layer_ops.act_and_mul(x, "gelu_pytorch_tanh")
    theirs = layer_ops.act_and_mul(x.cpu(), "gelu_pytorch_tanh").to(DEVICE)
    check(ours, theirs, gelu_tanh64(gate) * up, dtype)


ACTS64 = {"silu": lambda g: g * torch.sigmoid(g), "gelu_pytorch_tanh": gelu_tanh64}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", sorted(ACTS64))
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("inter,k", [(1536, 576), (8192, 2048), (2048, 640), (24, 40)])
def test_gemv_with_gated_epilogue(rows, inter, k, act, dtype):
    """gate_up's projection ending in the MLP's activation: act(x Wg^T) * (x Wu^T)."""
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
    w = torch.randn(2 * inter, k, device=DEVICE, dtype=dtype) * (2 / k ** 0.5)
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    exact = ACTS64[act](gate) * up
    theirs = layer_ops.act_and_mul(torch.nn.functional.linear(x, w), act)
    poison_allocations((rows, inter), dtype=dtype)
    ours = torch.ops.flashdecode.gemv(x, w, None, layer_ops.GATED_ACTIVATIONS[act])
    check(ours, theirs, exact, dtype)
    served = layer_ops.gated_linear(x, w, act)
    if layer_ops.gemv_serves(x, w):
        assert torch.equal(served, ours)
    else:
        check(served, theirs, exact, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("norm_dtype", ["model", "float32"], ids=["llama-norm", "gemma3-norm"])
@pytest.mark.parametrize("epilogue", ["plain", "bias", "silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("n,k", [(960, 576), (3072, 2048), (96, 40)])
def test_add_rms_norm_linear(rows, n, k, epilogue, norm_dtype, dtype):
    """The residual add and RMSNorm in front of a projection, in the GEMV for a few rows (one
    launch) and as the norm kernel then cuBLAS for more: against float64 and against the norm
    kernel then F.linear; the sum comes back exactly, the inputs are left as they were."""
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype) * 2
    residual = torch.randn(rows, k, device=DEVICE, dtype=dtype) * 2
    norm_weight = (1 + 0.3 * torch.randn(k, device=DEVICE)).to(dtype if norm_dtype == "model" else torch.float32)
    w = torch.randn(n, k, device=DEVICE, dtype=dtype) * (2 / k ** 0.5)
    bias = torch.randn(n, device=DEVICE, dtype=dtype) if epilogue == "bias" else None
    act = epilogue if epilogue in ACTS64 else None
    x_before, residual_before = x.clone(), residual.clone()

    summed64 = residual.double() + x.double()
    y64 = rms_norm64(summed64, norm_weight, 1e-6) @ w.double().T
    if bias is not None:
        y64 = y64 + bias.double()
    h, their_sum = layer_ops._rms_norm_torch(residual + x, norm_weight, 1e-6), residual + x
    theirs = torch.nn.functional.linear(h, w, bias)
    if act is not None:
        gate, up = y64.chunk(2, dim=-1)
        y64 = ACTS64[act](gate) * up
        theirs = layer_ops.act_and_mul(theirs, act)

    poison_allocations((rows, n // 2 if act else n), (rows, k), dtype=dtype)
    ours, summed = layer_ops.add_rms_norm_linear(x, residual, norm_weight, 1e-6, w, bias, act=act)
    assert torch.equal(summed, their_sum)
    check(ours, theirs, y64, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    if layer_ops.gemv_serves(x, w):       # the entry point took the fused GEMV: the op itself gives the same
        op, op_sum = torch.ops.flashdecode.add_rms_norm_gemv(x, residual, norm_weight, 1e-6, w, bias,
                                                             -1 if act is None else layer_ops.GATED_ACTIVATIONS[act])
        assert torch.equal(op, ours) and torch.equal(op_sum, summed)


def test_add_rms_norm_linear_refuses_a_bias_with_a_gated_epilogue():
    x = torch.randn(1, 64, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(32, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="takes no bias"):
        layer_ops.add_rms_norm_linear(x, x, torch.ones(64, device=DEVICE), 1e-6, w, torch.zeros(32, device=DEVICE),
                                      act="silu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 16])
@pytest.mark.parametrize("n,k", [(1152, 896), (100, 40)])
def test_linear_with_bias(rows, n, k, dtype):
    """Qwen2's q/k/v bias: in the GEMV's epilogue for a few rows, cuBLAS's for more."""
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
    w = torch.randn(n, k, device=DEVICE, dtype=dtype) / k ** 0.5
    bias = torch.randn(n, device=DEVICE, dtype=dtype)
    exact = x.double() @ w.double().T + bias.double()
    check(layer_ops.linear(x, w, bias), torch.nn.functional.linear(x, w, bias), exact, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 640), (64, 640), (5, 1152)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_with_float32_weight_rounds_once(rows, hidden, residual, dtype):
    """Gemma's norms: the folded ``1 + w`` kept in float32, scaled in float32 and rounded once, as
    Gemma3RMSNorm does; against float64 and against that module's arithmetic."""
    x = torch.randn(rows, hidden, device=DEVICE, dtype=dtype) * 3
    res = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
    weight = 1 + torch.randn(hidden, device=DEVICE, dtype=torch.float32) * 0.3
    summed = res + x if residual else x
    exact = rms_norm64(summed, weight, 1e-6)
    h = summed.float()
    theirs = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(dtype)
    if residual:
        ours, res_ours = layer_ops.add_rms_norm(x, res, weight, 1e-6)
        assert torch.equal(res_ours, summed)
    else:
        ours = layer_ops.rms_norm(x, weight, 1e-6)
    check(ours, theirs, exact, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_dtype", ["model", "float32"], ids=["qwen3-norm", "gemma3-norm"])
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (4, 1, 256), (14, 2, 64)])
def test_rope_write_kv_with_head_norms(hq, hkv, d, dtype, norm_dtype):
    """Qwen3's and Gemma 3's per-head q/k RMSNorm, fused in front of the rotation: against
    float64 and against transformers' order (norm in the low precision, then the rotation)."""
    tokens, block_size, num_blocks, max_positions, eps = 21, 16, 4, 4096, 1e-6
    table64 = rotary_table(max_positions, d)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=DEVICE, dtype=dtype) * 3
    weight_dtype = dtype if norm_dtype == "model" else torch.float32
    q_norm = torch.randn(d, device=DEVICE, dtype=weight_dtype)
    k_norm = torch.randn(d, device=DEVICE, dtype=weight_dtype)
    positions = torch.randint(0, max_positions, (tokens,), device=DEVICE, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens].to(torch.int32)
    k_cache = torch.full((num_blocks, hkv, block_size, d), float("nan"), device=DEVICE, dtype=dtype)
    v_cache = k_cache.clone()

    heads = qkv.double().unflatten(1, (-1, d))
    normed = torch.cat([rms_norm64(heads[:, :hq], q_norm, eps), rms_norm64(heads[:, hq:hq + hkv], k_norm, eps)], 1)
    cs = table64.to(DEVICE)[positions.long()].unsqueeze(1)
    half = d // 2
    x1, x2 = normed[..., :half], normed[..., half:]
    exact = torch.cat([x1 * cs[..., :half] - x2 * cs[..., half:], x2 * cs[..., :half] + x1 * cs[..., half:]], -1)

    low = qkv.unflatten(1, (-1, d))
    low = torch.cat([layer_ops._rms_norm_torch(low[:, :hq], q_norm, eps),
                     layer_ops._rms_norm_torch(low[:, hq:hq + hkv], k_norm, eps)], 1)
    cos = cs[..., :half].repeat(1, 1, 2).to(dtype)
    sin = cs[..., half:].repeat(1, 1, 2).to(dtype)
    theirs = low * cos + torch.cat([-low[..., half:], low[..., :half]], dim=-1) * sin

    ours = qkv.clone()
    layer_ops.rope_write_kv(ours, positions, table64.float().to(DEVICE), k_cache, v_cache, slots, hq,
                            q_norm=q_norm, k_norm=k_norm, eps=eps)
    ours_heads = ours.unflatten(1, (-1, d))
    check(ours_heads[:, :hq + hkv], theirs, exact, dtype)
    assert torch.equal(ours_heads[:, hq + hkv:], qkv.unflatten(1, (-1, d))[:, hq + hkv:])   # values untouched
    s = slots.long()
    assert torch.equal(k_cache[s // block_size, :, s % block_size], ours_heads[:, hq:hq + hkv])
    assert torch.equal(v_cache[s // block_size, :, s % block_size], ours_heads[:, hq + hkv:])

RAW_OP_ERRORS = {
    "flash-decode-head-dim-96": ("q = torch.randn(1, 4, 96, device='cuda', dtype=torch.bfloat16)\n"
                                 "kc = torch.randn(2, 2, 16, 96, device='cuda', dtype=torch.bfloat16)\n"
                                 "i32 = dict(device='cuda', dtype=torch.int32)\n"
                                 "po = torch.empty(4, 4, 96, device='cuda'); pl = torch.empty(4, 4, device='cuda')\n"
                                 "call = lambda: torch.ops.flashdecode.flash_decode(q, kc, kc, torch.tensor([[0, 1]], **i32), "
                                 "torch.tensor([20], **i32), 0.1, 1, False, po, pl)\n",
                                 "head_dim must be 64, 128 or 256, got 96"),
    "flash-decode-negative-window": ("q = torch.randn(1, 4, 64, device='cuda', dtype=torch.bfloat16)\n"
                                     "kc = torch.randn(2, 2, 16, 64, device='cuda', dtype=torch.bfloat16)\n"
                                     "i32 = dict(device='cuda', dtype=torch.int32)\n"
                                     "po = torch.empty(4, 4, 64, device='cuda'); pl = torch.empty(4, 4, device='cuda')\n"
                                     "call = lambda: torch.ops.flashdecode.flash_decode(q, kc, kc, "
                                     "torch.tensor([[0, 1]], **i32), torch.tensor([20], **i32), 0.1, 1, False, po, pl, "
                                     "True, -1)\n",
                                     "window must be in 0.."),
    "flash-decode-three-per-sm-for-a-group-of-9": (
        "q = torch.randn(1, 18, 64, device='cuda', dtype=torch.bfloat16)\n"
        "kc = torch.randn(2, 2, 16, 64, device='cuda', dtype=torch.bfloat16)\n"
        "i32 = dict(device='cuda', dtype=torch.int32)\n"
        "po = torch.empty(4, 18, 64, device='cuda'); pl = torch.empty(4, 18, device='cuda')\n"
        "call = lambda: torch.ops.flashdecode.flash_decode(q, kc, kc, torch.tensor([[0, 1]], **i32), "
        "torch.tensor([20], **i32), 0.1, 2, True, po, pl)\n",
        "the three-per-SM plan is two splits at head_dim 64 with at most 8"),
    "gemv-gated-with-bias": ("x = torch.randn(1, 64, device='cuda', dtype=torch.bfloat16)\n"
                             "w = torch.randn(32, 64, device='cuda', dtype=torch.bfloat16)\n"
                             "call = lambda: torch.ops.flashdecode.gemv(x, w, torch.zeros(32, device='cuda', "
                             "dtype=torch.bfloat16), 0)\n", "takes no bias"),
    "gemv-too-many-rows": ("x = torch.randn(5, 64, device='cuda', dtype=torch.bfloat16)\n"
                           "w = torch.randn(32, 64, device='cuda', dtype=torch.bfloat16)\n"
                           "call = lambda: torch.ops.flashdecode.gemv(x, w)\n", "at most"),
    "rms-norm-bad-width": ("x = torch.randn(3, 64, device='cuda', dtype=torch.bfloat16)\n"
                           "w = torch.randn(32, device='cuda', dtype=torch.bfloat16)\n"
                           "call = lambda: torch.ops.flashdecode.rms_norm(x, w, 1e-6)\n", "must be [rows"),
}


@pytest.mark.parametrize("case", sorted(RAW_OP_ERRORS))
def test_raw_op_refuses_bad_input_with_an_error(case):
    # In a child process: a crash there must fail this test, not the whole run.
    setup, message = RAW_OP_ERRORS[case]
    code = ("import torch; from kernels import ops; ops.load()\n" + setup +
            "try:\n    call()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    child = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                           timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert child.returncode == 0 and "refused:" in child.stdout and message in child.stdout, \
        (child.returncode, child.stdout[-500:], child.stderr[-3000:])


def test_gemv_entry_point_falls_back_to_cublas_past_its_rows():
    x = torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(32, 64, device=DEVICE, dtype=torch.bfloat16)
    assert not layer_ops.gemv_serves(x, w)
    assert torch.equal(layer_ops.linear(x, w), torch.nn.functional.linear(x, w))
