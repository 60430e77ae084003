"""The CPU path's pieces against float64: ggml blocks as packed int4 matmuls, the quantised
embedding, the split-KV decode over cache blocks, and the --cpu-weights choice."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

import kernels
from models.cpu_attention import DecodePlan, split_kv_decode, write_new_kv
from models.cpu_llama import cpu_forward, decode_parallel_bytes, interleave_rows
from models.quantized import GgufTensor, Int4Linear, QuantizedEmbedding, linear_from_gguf, read_gguf
from server.cli import engine_options, parse_args

TYPES = [QT.Q4_0, QT.Q4_1, QT.Q8_0]


def random_tensor(qtype: QT, rows: int, cols: int, seed: int) -> GgufTensor:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 0.3, (rows, 1)) + rng.uniform(-0.05, 0.05, (rows, 1)))
    return GgufTensor("w", qtype, (rows, cols), quantize(w.astype(np.float32), qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_linear_is_the_blocks_weights(qtype, rows):
    """Error bound: bfloat16 scales (2^-9 relative) and a bfloat16 output (2^-9 relative per
    partial sum, two for Q8_0), so |y - y64| <= 2^-7 * (|x| @ |W|.T); a wrong zero point or
    nibble order is off by whole quantisation steps, far beyond it."""
    t = random_tensor(qtype, 96, 256, seed=rows)
    lin = linear_from_gguf(t)
    assert isinstance(lin, Int4Linear) and len(lin.parts) == (2 if qtype == QT.Q8_0 else 1)
    w = torch.from_numpy(t.dequantize()).double()            # the gguf package's own dequantisation
    x = torch.randn(rows, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = lin(x).double()
    exact = x.double() @ w.T
    bound = 2 ** -7 * (x.double().abs() @ w.abs().T)
    assert got.shape == (rows, 96) and got.dtype == torch.float64
    assert ((got - exact).abs() <= bound).all(), ((got - exact).abs() / bound).max()
    # the bound is tight enough to catch a zero point off by one quantisation step of one group
    shifted = exact + x.double()[:, :32].sum(-1, keepdim=True) * w[:, :32].abs().mean()
    assert not ((shifted - exact).abs() <= bound).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantized_embedding_is_exact(qtype):
    t = random_tensor(qtype, 50, 128, seed=1)
    ids = torch.tensor([0, 49, 7, 7, 31])
    assert torch.equal(QuantizedEmbedding(t)(ids), torch.from_numpy(t.dequantize())[ids])


def test_types_without_an_int4_form_run_dense():
    # random Q6_K blocks (gguf cannot quantise to it): 210 bytes per 256 values, the fp16 scale last
    blocks = np.random.default_rng(2).integers(0, 256, (16, 2, 210), dtype=np.uint8)
    blocks[..., 208:] = np.full((16, 2, 1), 0.01, dtype=np.float16).view(np.uint8)
    t = GgufTensor("w", QT.Q6_K, (16, 512), blocks.reshape(16, 420))
    lin = linear_from_gguf(t)
    x = torch.randn(3, 512).bfloat16()
    ref = x.double() @ torch.from_numpy(t.dequantize()).double().T
    assert not isinstance(lin, Int4Linear)
    assert (lin(x).double() - ref).abs().max() <= 2 ** -6 * ref.abs().max()


def write_small_gguf(path, seed: int) -> dict[str, np.ndarray]:
    """A file of a few tensors of different types; what each holds, as gguf writes it."""
    rng = np.random.default_rng(seed)
    written = {"a.weight": quantize(rng.standard_normal((8, 64)).astype(np.float32), QT.Q4_1),
               "b.weight": quantize(rng.standard_normal((4, 32)).astype(np.float32), QT.Q8_0),
               "c.weight": rng.standard_normal(48).astype(np.float32)}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(500)])
    writer.add_tensor("a.weight", written["a.weight"], raw_dtype=QT.Q4_1)
    writer.add_tensor("b.weight", written["b.weight"], raw_dtype=QT.Q8_0)
    writer.add_tensor("c.weight", written["c.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def test_the_tensor_table_kept_in_the_cache_reads_what_gguf_reads(tmp_path, monkeypatch):
    """The second read comes from the table kept beside the conversion, not gguf's parse; an edited
    file is parsed anew."""
    monkeypatch.setenv("FLASHDECODE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "small.gguf"
    write_small_gguf(path, seed=0)
    parses = []
    monkeypatch.setattr("models.quantized.GGUFReader", lambda p: parses.append(p) or gguf.GGUFReader(p))
    expected = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for _ in range(2):
        arch, tensors = read_gguf(path)
        assert arch == "llama" and tensors.keys() == expected.keys()
        for name, t in tensors.items():
            want = expected[name]
            assert (t.qtype, t.shape) == (want.tensor_type, tuple(int(n) for n in reversed(want.shape)))
            assert t.data.dtype == want.data.dtype and np.array_equal(t.data, want.data)
    assert len(parses) == 1 and list((tmp_path / "cache" / "models").glob("small-*.tensors.json"))

    written = write_small_gguf(path, seed=1)
    _, tensors = read_gguf(path)
    assert len(parses) == 2
    assert np.array_equal(tensors["a.weight"].data, written["a.weight"])
    assert np.array_equal(tensors["c.weight"].data, written["c.weight"])


def test_rows_reorder_keeps_blocks():
    t = random_tensor(QT.Q4_1, 128, 64, seed=3)
    order = interleave_rows(2, 64)
    assert np.array_equal(t.rows(order).dequantize(), t.dequantize()[order])


def attention64(q, k, v, lens):
    """float64 softmax attention, q [B, Hq, D], dense k/v [B, Hkv, M, D]."""
    out = []
    group = q.shape[1] // k.shape[1]
    for b, n in enumerate(lens):
        kb = k[b, :, :n].repeat_interleave(group, 0)
        vb = v[b, :, :n].repeat_interleave(group, 0)
        p = torch.softmax((q[b].unsqueeze(1) @ kb.transpose(-1, -2)) / q.shape[-1] ** 0.5, dim=-1)
        out.append((p @ vb)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
@pytest.mark.parametrize("lens", [[1], [16], [17], [40], [5, 48, 33], [64, 2, 16]])
def test_split_kv_decode_matches_float64_softmax(lens, shuffle):
    g = torch.Generator().manual_seed(len(lens) * 100 + lens[0] + shuffle)
    batch, hq, hkv, d, bs = len(lens), 9, 3, 64, 16
    width = max(lens)
    k = torch.randn(batch, hkv, width, d, generator=g, dtype=torch.float64) * 2
    v = torch.randn(batch, hkv, width, d, generator=g, dtype=torch.float64)
    q = torch.randn(batch, hq, d, generator=g, dtype=torch.float64) * 2
    k_cache, v_cache, table = kernels.pack_paged(k, v, bs, shuffle=shuffle, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    last = seq_lens.long() - 1
    slots = (table[torch.arange(batch), last // bs].long() * bs + last % bs).to(torch.int32)
    plan = DecodePlan.make(table, seq_lens, slots, bs)
    row = table[0].tolist()
    in_place = batch == 1 and row == list(range(row[0], row[0] + len(row)))    # one sequence, blocks in order
    assert (plan.first_block is not None) == in_place, (plan.first_block, table)
    # the step's new token goes through write_new_kv, as in the model
    new_k, new_v = k[torch.arange(batch), :, last], v[torch.arange(batch), :, last]
    k_cache[plan.slot_blocks, :, plan.slot_rows] = 0
    write_new_kv(k_cache, v_cache, new_k, new_v, plan)
    got = split_kv_decode(q, k_cache, v_cache, plan, scale=d ** -0.5)
    expected = attention64(q, k, v, lens)
    assert (got - expected).abs().max() < 1e-12
    ours32 = split_kv_decode(q.float(), k_cache.float(), v_cache.float(), plan, scale=d ** -0.5)
    reference32 = kernels.reference_decode(q.float(), k_cache.float(), v_cache.float(), table, seq_lens)
    assert (ours32.double() - expected).abs().max() < 1e-5
    assert (ours32 - reference32).abs().max() < 1e-5


def test_cpu_weights_choice_is_checked():
    from transformers import AutoModelForCausalLM

    from models.presets import preset_config
    model = AutoModelForCausalLM.from_config(preset_config("tiny"))
    with pytest.raises(ValueError, match="'fast' is not one of auto, quantized, float"):
        cpu_forward(model, None, "fast", 64)
    with pytest.raises(ValueError, match="needs a .gguf model"):
        cpu_forward(model, None, "quantized", 64)
    assert cpu_forward(model, None, "auto", 64).describe.startswith("float")


def test_cli_passes_cpu_weights():
    assert engine_options(parse_args(["--cpu-weights", "float"]))["cpu_weights"] == "float"
    assert "cpu_weights" not in engine_options(parse_args([]))
    with pytest.raises(SystemExit):
        parse_args(["--cpu-weights", "int3"])


@pytest.mark.parametrize("policy, wide", [("PASSIVE", 4 << 20), ("active", 0), (None, 0)])
def test_decode_matmuls_on_all_threads_only_where_it_pays(monkeypatch, policy, wide):
    # a sleeping pool's wake-up outweighs a small matmul's second thread; a spinning one's does not
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    assert decode_parallel_bytes() == wide


def test_a_conversion_parses_each_file_and_builds_each_name_map_once(tmp_path):
    from models.loader import _gguf_work_done_once

    path = tmp_path / "small.gguf"
    write_small_gguf(path, seed=0)
    reader_class, map_function = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError):
        with _gguf_work_done_once():
            first = gguf.GGUFReader(str(path))
            assert gguf.GGUFReader(path) is first and first.tensors[0].name == "a.weight"
            name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
            assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is name_map
            assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not name_map
            raise RuntimeError("a failed conversion")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, map_function)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_the_float_step_holds_the_models_weights_once():
    """The float step's stacked q/k/v and gate/up hold the model's v, gate and up weights (the
    modules point at its rows), its own reordered copy of q and k; the model computes as before."""
    import copy

    from models import load_model

    model = load_model("random:tiny", dtype="float32", device="cpu").model
    reference = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    step = cpu_forward(model, None, "float", 64)
    within = lambda w, stacked: (w.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr())
    for layer, ref, (_, qkv, _, _, gate_up, _) in zip(model.model.layers, reference.model.layers, step.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert within(attn.v_proj.weight, qkv.weight) and not within(attn.q_proj.weight, qkv.weight)
        assert within(mlp.gate_proj.weight, gate_up.weight) and within(mlp.up_proj.weight, gate_up.weight)
        for name in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(getattr(attn, name).weight, getattr(ref.self_attn, name).weight)
        for name in ("gate_proj", "up_proj"):
            assert torch.equal(getattr(mlp, name).weight, getattr(ref.mlp, name).weight)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)
