"""The split planner: the plans measured best on the H200 (132 SMs), and its invariants."""

import pytest

from kernels import constants, planner
from kernels.constants import MIN_CHUNK, nvcc_defines
from kernels.planner import Plan, max_splits_for, plan_num_splits, split_plan, wave_fill

H200_SMS = 132


@pytest.mark.parametrize("batch,kv_heads,max_len,expected", [
    (1, 3, 131072, 44),    # one block per SM, 132 of 132
    (1, 8, 32768, 16),     # 128 of 132
    (8, 3, 4096, 5),       # 120 of 132: one spread wave beat 11 splits at two per SM (12.5 vs 13.5 us)
    (8, 8, 4096, 2),       # 128 of 132
    (1, 3, 512, 2),        # capped by the minimum chunk: 512 tokens make two splits
    (64, 3, 4096, 1),      # 192 work items: no even wave, too short to split for the tail
    (64, 3, 131072, 4),    # long: the fewest splits that fill whole waves of 264 slots
])
def test_measured_plans(batch, kv_heads, max_len, expected):
    assert plan_num_splits(batch, kv_heads, H200_SMS, max_len) == expected


@pytest.mark.parametrize("batch,kv_heads,max_len,expected", [
    (64, 3, 4096, 2),      # 384 blocks: one wave of three four-warp blocks per SM (49.6 against 53.0 us)
    (64, 3, 512, 1),       # too short: 9.7 against 8.6 us
    (64, 3, 131072, 4),    # long: the wave-filling plan of two per SM comes first
    (32, 3, 4096, 1),      # 192 blocks would fill half of the 396 slots
    (8, 3, 4096, 5),       # the one-wave plans come first
])
def test_three_blocks_per_sm(batch, kv_heads, max_len, expected):
    """Head_dim 64 with groups of at most eight heads: two splits where they fill one wave of three
    blocks per SM."""
    assert plan_num_splits(batch, kv_heads, H200_SMS, max_len, three_per_sm=True) == expected


@pytest.mark.parametrize("three_per_sm", [False, True])
@pytest.mark.parametrize("batch", [1, 2, 3, 7, 16, 64, 255, 256])
@pytest.mark.parametrize("kv_heads", [1, 3, 8])
@pytest.mark.parametrize("max_len", [1, 255, 256, 4097, 131072])
def test_plans_stay_in_bounds(batch, kv_heads, max_len, three_per_sm):
    splits = plan_num_splits(batch, kv_heads, H200_SMS, max_len, three_per_sm=three_per_sm)
    assert 1 <= splits <= max_splits_for(max_len)
    assert splits == 1 or max_len > (splits - 1) * MIN_CHUNK   # no split is empty by plan


def test_wave_fill():
    assert wave_fill(264, 264) == 1.0
    assert wave_fill(265, 264) == pytest.approx(265 / 528)


def test_rejects_empty_work():
    with pytest.raises(ValueError):
        plan_num_splits(0, 3, H200_SMS, 100)


@pytest.mark.parametrize("shape,batch,max_len,expected", [
    ((9, 3, 64), 64, 4096, Plan(2, three_per_sm=True)),    # four-warp blocks, three per SM
    ((9, 3, 64), 8, 4096, Plan(5)),
    ((32, 8, 128), 64, 4096, Plan(1)),                     # head_dim 128 never runs three per SM
    ((32, 2, 64), 64, 4096, Plan(1)),                      # groups of 16 keep eight warps
    ((40, 2, 64), 1, 32768, Plan(33)),                     # groups of 20: two blocks per KV head (4 items)
])
def test_split_plan_of_a_head_layout(shape, batch, max_len, expected):
    num_q, num_kv, dim = shape
    assert split_plan(batch, num_q, num_kv, dim, H200_SMS, max_len) == expected


def test_the_plan_depends_on_the_kv_heads():
    """A plan made for Hq KV heads on a GQA call is another plan (it ran 3x slower on the H200)."""
    assert split_plan(8, 9, 3, 64, H200_SMS, 32768) != split_plan(8, 9, 9, 64, H200_SMS, 32768)


def test_split_plan_refuses_a_head_count_that_is_not_a_multiple():
    with pytest.raises(ValueError, match="num_q_heads 9 must be a multiple of num_kv_heads 2"):
        split_plan(1, 9, 2, 64, H200_SMS, 4096)


def test_the_shared_constants_reach_the_compiler_once_each():
    expected = []
    for name in constants.SHARED:
        value = getattr(constants, name)
        expected += ([f"-DFLASHDECODE_{name}_{i}={v}" for i, v in enumerate(value)] if isinstance(value, tuple)
                     else [f"-DFLASHDECODE_{name}={value}"])
    assert nvcc_defines() == expected
    assert len({d.split("=")[0] for d in expected}) == len(expected)
    assert planner.MAX_SPLITS <= constants.MAX_SPLITS


@pytest.fixture
def hopper_sms(monkeypatch):
    """Workspaces on the CPU planned as on a 132-SM GPU."""
    from kernels import workspace
    monkeypatch.setattr(workspace, "device_sm_count", lambda device: H200_SMS)


@pytest.mark.parametrize("batch,max_len,bf16_splits,int8_splits", [
    (8, 32768, 16, 32),     # 128 blocks of 132: doubled (H100: 114 -> 80 us)
    (64, 4096, 2, 4),       # 128 blocks (114 -> 77 us)
    (64, 32768, 2, 4),      # (857 -> 520 us)
    (256, 4096, 1, 1),      # 256 blocks already two per SM: doubling lost (262 -> 277 us)
    (1, 32768, 128, 128),   # capped: the workspace plans at most max_splits_for(max_len)
])
def test_int8_caches_at_head_dim_256_plan_two_blocks_per_sm(hopper_sms, batch, max_len, bf16_splits, int8_splits):
    from kernels import Workspace
    bf16 = Workspace(batch, 4, 256, max_len, "cpu", num_kv_heads=1)
    int8 = Workspace(batch, 4, 256, max_len, "cpu", num_kv_heads=1, kv_int8=True)
    assert (bf16.num_splits(batch), int8.num_splits(batch)) == (bf16_splits, int8_splits)
    assert int8.capacity_rows >= batch * int8_splits


@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128)])
def test_int8_caches_at_other_head_dims_keep_the_bf16_plan(hopper_sms, shape):
    from kernels import Workspace
    num_q, num_kv, dim = shape
    for batch, max_len in ((1, 32768), (8, 4096), (64, 32768), (256, 4096)):
        bf16 = Workspace(batch, num_q, dim, max_len, "cpu", num_kv_heads=num_kv)
        int8 = Workspace(batch, num_q, dim, max_len, "cpu", num_kv_heads=num_kv, kv_int8=True)
        assert int8.plan(batch) == bf16.plan(batch), (shape, batch, max_len)


def test_a_workspace_refuses_caches_of_the_other_kind():
    import torch
    import kernels
    from kernels.kv_quant import quantize_rows
    ws = kernels.Workspace(2, 4, 64, 256, "cpu", num_kv_heads=2)
    q = torch.randn(2, 4, 64)
    k = torch.randn(4, 2, 32, 64)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([40, 64], dtype=torch.int32)
    k8, k_scale = quantize_rows(k)
    with pytest.raises(ValueError, match="planned for bf16/fp16 caches, this call has int8"):
        kernels.flash_decode(q, k8, k8, table, lens, workspace=ws, k_scale=k_scale, v_scale=k_scale)
    ws8 = kernels.Workspace(2, 4, 64, 256, "cpu", num_kv_heads=2, kv_int8=True)
    with pytest.raises(ValueError, match="planned for int8 caches, this call has bf16/fp16"):
        kernels.flash_decode(q, k, k, table, lens, workspace=ws8)
