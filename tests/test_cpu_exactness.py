"""The CPU step on the GGUF's quantised weights computes the same model as the dequantised
float32 path, up to the rounding of its bfloat16 activations.

Tolerance: the quantised path rounds every matmul's input and output to bfloat16 (the int4
kernel's fast path takes nothing else) and the group scales to bfloat16; its weights are the
file's exactly otherwise. The same model run wholly in bfloat16 (dequantised weights rounded to
bfloat16, bfloat16 residual stream) is the plain low-precision run of the same math; as in
FlashAttention's tests, the quantised path passes when its distance from float32 is at most
twice that run's (it keeps the residual stream in float32, so it is usually closer).
"""

import pytest
import torch

from models import AttentionBatch, cpu_forward, load_model
from models.cpu_llama import FLOAT_ROWS, from_gguf
from models.cpu_threads import ALL_THREADS, ONE_THREAD
from models.quantized import DenseLinear, Int4Linear
from server.engine import Engine, EngineConfig, SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.model_runner import ModelRunner
from server.engine.sequence import Sequence

import kernels

from .helpers import chat_ids, run_all

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
           "Explain in one paragraph why the sky is blue, then list three colours."]

TEXT = ("The sky looks blue because air molecules scatter short blue wavelengths of sunlight far more than "
        "the longer red ones; this is Rayleigh scattering, and it is why sunsets look red and orange. Clouds "
        "are white because their droplets scatter every colour about equally, and the ocean looks blue partly "
        "because water absorbs red light. Snow is white for the same reason. In the mountains the sky is a "
        "deeper blue, since there is less air above to scatter light back towards the eye, and astronauts see "
        "a black sky in daylight. Mars has a butterscotch sky by day and blue sunsets, because its fine dust "
        "scatters light differently from the gases of our air. Painters have long mixed ultramarine, cobalt "
        "and cerulean to catch these shades, and photographers wait for the blue hour after sunset, when the "
        "sun is below the horizon and the remaining light is scattered, soft and cool. Poets have written of "
        "the sea and the sky as mirrors of each other, though each owes its colour to different physics: one "
        "scatters, the other absorbs. Children ask about it, scientists answered it in the nineteenth century, "
        "and the answer still surprises people who hear it for the first time, which is part of its charm.")

TOKENS = 256
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def fp32():
    return load_model("default", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def bf16():
    return load_model("default", dtype="bfloat16", device="cpu")


@pytest.fixture(scope="module")
def tokens(fp32):
    ids = chat_ids(fp32.tokenizer, PROMPTS[2]) + fp32.tokenizer(TEXT)["input_ids"]
    assert len(ids) >= TOKENS + DECODE_STEPS
    return ids[:TOKENS + DECODE_STEPS]


def prefill_all_logits(step, ids: list[int], dtype, logits_rows=None) -> torch.Tensor:
    """Logits at every position of one prefill over ``ids`` (at ``logits_rows`` only, if given)."""
    n, block_size = len(ids), 16
    blocks = -(-n // block_size)
    shape = kernels.cache_shape(blocks, step.num_kv_heads, block_size, step.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in step.layers]
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32).view(1, -1)
    positions = torch.arange(n, dtype=torch.int32)
    slots = (table[0, positions // block_size] * block_size + positions % block_size).to(torch.int32)
    batch = AttentionBatch(caches, slots, table, torch.tensor([n], dtype=torch.int32), is_decode=False,
                           query_starts=[0, n], context_lens=[0])
    with torch.inference_mode():
        return step(torch.tensor([ids], dtype=torch.int32), positions.view(1, -1), batch, logits_rows).float()


def decode_logits(loaded, cpu_weights: str, ids: list[int], steps: int) -> torch.Tensor:
    """Prefill ``ids[:-steps]``, then decode the last ``steps`` tokens teacher-forced."""
    runner = ModelRunner(loaded, EngineConfig(max_batch=2, num_blocks=64, block_size=16, cpu_weights=cpu_weights),
                         max_model_len=512)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seq = Sequence("tf", ids[:-steps], SamplingParams(), seed=0)
    blocks.grow(seq.block_table, seq.length)
    got = [runner.prefill([(seq, seq.length)])[0]]
    seq.num_cached = seq.length
    for token in ids[-steps:-1]:
        seq.append(token)
        blocks.grow(seq.block_table, seq.length)
        got.append(runner.decode([seq])[0])
        seq.num_cached = seq.length
    return torch.stack(got).float()


def test_quantized_path_runs_the_files_weights(fp32):
    step = cpu_forward(fp32.model, fp32.gguf_path, "auto", 512)
    assert step.describe.startswith("quantized") and "Q4_1" in step.describe and "0 dense" in step.describe


def test_teacher_forced_logits_within_bf16_rounding(fp32, bf16, tokens):
    prefill = tokens[:TOKENS]
    reference = prefill_all_logits(cpu_forward(fp32.model, None, "float", 512), prefill, torch.float32)
    quantized = prefill_all_logits(from_gguf(fp32.model, fp32.gguf_path, 512), prefill, torch.float32)   # int4 on any CPU
    low = prefill_all_logits(cpu_forward(bf16.model, None, "float", 512), prefill, torch.bfloat16)
    err_q, err_low = (quantized - reference).abs().max().item(), (low - reference).abs().max().item()
    assert err_q <= 2 * err_low, (err_q, err_low)
    assert (quantized.argmax(-1) == reference.argmax(-1)).float().mean() >= (low.argmax(-1) == reference.argmax(-1)).float().mean() - 0.02

    ref_d = decode_logits(fp32, "float", tokens, DECODE_STEPS)
    q_d = decode_logits(fp32, "quantized", tokens, DECODE_STEPS)
    low_d = decode_logits(bf16, "float", tokens, DECODE_STEPS)
    err_qd, err_lowd = (q_d - ref_d).abs().max().item(), (low_d - ref_d).abs().max().item()
    assert err_qd <= 2 * err_lowd, (err_qd, err_lowd)
    assert torch.allclose(ref_d[0], reference[-1], atol=1e-3)     # the decode steps continue that prefill
    print(f"max |logit error| prefill {err_q:.3f} (bf16 run {err_low:.3f}), decode {err_qd:.3f} ({err_lowd:.3f})")


def count_matmuls(monkeypatch) -> dict:
    """Calls of the int4 and the dense projections from now on."""
    counts = {"int4": 0, "dense": 0}
    for kind, cls in (("int4", Int4Linear), ("dense", DenseLinear)):
        original = cls.__call__
        monkeypatch.setattr(cls, "__call__", lambda self, x, kind=kind, original=original:
                            (counts.__setitem__(kind, counts[kind] + 1), original(self, x))[1])
    return counts


def test_steps_of_many_rows_run_the_float32_weights(fp32, tokens, monkeypatch):
    """With ``float_rows`` (on PyTorch's AVX2 kernels) a quantised step of that many rows or more
    runs the model's float32 weights, so its logits are the float step's; shorter steps and a
    prefill's head over fewer rows run the int4 weights."""
    float_step = cpu_forward(fp32.model, None, "float", 512)
    step = from_gguf(fp32.model, fp32.gguf_path, 512, float_rows=FLOAT_ROWS)
    int4_step = from_gguf(fp32.model, fp32.gguf_path, 512)
    counts = count_matmuls(monkeypatch)
    many = tokens[:FLOAT_ROWS + 5]
    got = prefill_all_logits(step, many, torch.float32)
    assert counts == {"int4": 0, "dense": 4 * len(step.layers) + 1}, counts
    want = prefill_all_logits(float_step, many, torch.float32)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()

    few = tokens[:FLOAT_ROWS - 1]
    counts.update(int4=0, dense=0)
    got = prefill_all_logits(step, few, torch.float32)
    assert counts == {"int4": 4 * len(step.layers) + 1, "dense": 0}, counts
    assert torch.equal(got, prefill_all_logits(int4_step, few, torch.float32))

    counts.update(int4=0, dense=0)                  # the layers on float32, the head on one row: int4
    prefill_all_logits(step, many, torch.float32, logits_rows=torch.tensor([len(many) - 1]))
    assert counts == {"int4": 1, "dense": 4 * len(step.layers)}, counts


@pytest.mark.parametrize("capability, rows", [("AVX2", FLOAT_ROWS), ("AVX512", None), ("DEFAULT", None)])
def test_the_float32_weights_serve_many_rows_on_avx2_kernels_only(fp32, bf16, monkeypatch, capability, rows):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    step = cpu_forward(fp32.model, fp32.gguf_path, "quantized", 512)
    assert step.float_rows == rows
    assert (f"steps of {FLOAT_ROWS} rows or more on the float32 weights" in step.describe) == (rows is not None)
    assert cpu_forward(bf16.model, bf16.gguf_path, "quantized", 512).float_rows is None    # no float32 weights
    with pytest.raises(ValueError, match="float32 weights, not torch.bfloat16"):
        from_gguf(bf16.model, bf16.gguf_path, 512, float_rows=FLOAT_ROWS)


@pytest.fixture(scope="module")
def engines(fp32):
    made = {w: Engine(fp32, EngineConfig(max_batch=4, num_blocks=64, block_size=16, cpu_weights=w))
            for w in ("quantized", "float")}
    for engine in made.values():
        engine.start()
    yield made
    for engine in made.values():
        engine.shutdown()


# Largest logit error of the quantised path over the decode steps above is about 0.4, of a run
# in bfloat16 0.45: a float32 choice whose top two logits are closer than this is not decided.
UNDECIDED_MARGIN = 1.0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_answers_identical_to_float(fp32, engines, prompt):
    """One request at a time, 32 tokens: identical, or the first token that differs is one that
    float32 itself decides by less than rounding (the poem's fifth: top two logits 14.19 and
    14.11)."""
    ids = chat_ids(fp32.tokenizer, prompt)
    request = [(ids, SamplingParams(max_new_tokens=32))]
    (q_tokens, q_text, _), = run_all(engines["quantized"], request)
    (f_tokens, f_text, _), = run_all(engines["float"], request)
    if q_tokens == f_tokens:
        return
    first = next(i for i, (a, b) in enumerate(zip(q_tokens + [-1], f_tokens + [-2])) if a != b)
    with torch.inference_mode():
        logits = fp32.model(torch.tensor([ids + f_tokens[:first]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    assert top2[0] - top2[1] < UNDECIDED_MARGIN, (first, (top2[0] - top2[1]).item(), q_text, f_text)


def test_paris(fp32, engines):
    (tokens, text, finish), = run_all(engines["quantized"],
                                      [(chat_ids(fp32.tokenizer, PROMPTS[0]), SamplingParams(max_new_tokens=16))])
    assert "Paris" in text


def one_decode_step(step, ids: list[int]) -> torch.Tensor:
    """Prefill ``ids[:-1]`` into blocks in order (read in place), then decode ``ids[-1]``."""
    n, block_size = len(ids), 16
    shape = kernels.cache_shape(-(-n // block_size), step.num_kv_heads, block_size, step.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in step.layers]
    table = torch.arange(shape[0], dtype=torch.int32).view(1, -1)
    positions = torch.arange(n, dtype=torch.int32)
    step(torch.tensor([ids[:-1]], dtype=torch.int32), positions[:-1].view(1, -1),
         AttentionBatch(caches, positions[:-1], table, torch.tensor([n - 1], dtype=torch.int32), is_decode=False,
                        query_starts=[0, n - 1], context_lens=[0]))
    return step(torch.tensor([[ids[-1]]], dtype=torch.int32), positions[-1:].view(1, 1),
                AttentionBatch(caches, positions[-1:], table, torch.tensor([n], dtype=torch.int32), is_decode=True))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_decode_step_threads_change_nothing_but_speed(fp32, tokens, monkeypatch, compiled):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    step = cpu_forward(fp32.model, fp32.gguf_path, "quantized", 512)
    assert step.compiled
    step.compiled = compiled
    step.threads.interval = 10 ** 9                      # the chooser does not probe
    # widened for the step: compiled, its layers once and the head; eager, qkv, o, gate_up, down per layer and the head
    widened_all = 2 if compiled else 4 * len(step.layers) + 1
    calls = []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), set_threads(n)))
    try:
        got = {}
        # every matmul on both threads / none / every op on one thread, the process left on one
        for name, parallel_bytes, mode in (("all", 0, ALL_THREADS), ("head", 1 << 62, ALL_THREADS),
                                           ("one", 0, ONE_THREAD)):
            step.parallel_bytes, step.threads.mode = parallel_bytes, mode
            step.compiled_threads = step._layer_threads(mode)        # compiled for this mode's count
            step.threads.apply()
            calls.clear()
            got[name] = one_decode_step(step, tokens[:40])
            if mode == ONE_THREAD:
                assert set(calls) == {1} and torch.get_num_threads() == 1, calls
            else:
                widened = calls.count(2) - 2             # the prefill's and the step's last set the two
                assert widened == (widened_all if name == "all" else 0), calls
                assert torch.get_num_threads() == 2
    finally:
        monkeypatch.undo()
        torch.set_num_threads(before)
    for name in ("head", "one"):
        assert torch.allclose(got["all"], got[name], atol=1e-3, rtol=0), (got["all"] - got[name]).abs().max()


@pytest.mark.parametrize("length", [2, 17, 32, 70])
@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "shuffled"])
@torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)       # not eager behind the test's back
def test_compiled_decode_step_equals_eager(fp32, tokens, length, in_order):
    """The compiled one-sequence step (models.cpu_decode) against the eager layers on the same
    cache: one cached block and several, the new token first or last in its block, blocks read in
    place or gathered, garbage past the sequence's end. Both round the same matmul inputs to
    bfloat16 and differ in the order of float32 sums only, which moves some bfloat16 roundings: the
    first layer's new key and value rows must agree within 1e-2, the logits within the quantised
    path's own bound against float32 (UNDECIDED_MARGIN); the teacher-forced test above holds the
    compiled step to float32."""
    step = cpu_forward(fp32.model, fp32.gguf_path, "quantized", 512)
    ids, block_size = tokens[:length], 16
    blocks = -(-length // block_size) + 1
    shape = kernels.cache_shape(blocks, step.num_kv_heads, block_size, step.head_dim)
    order = torch.arange(blocks) if in_order else torch.randperm(blocks, generator=torch.Generator().manual_seed(length))
    table = order.to(torch.int32).view(1, -1)
    positions = torch.arange(length, dtype=torch.int32)
    slots = (table[0, positions // block_size] * block_size + positions % block_size).to(torch.int32)
    garbage = torch.Generator().manual_seed(1)                      # rows past the sequence must not count
    prefilled = [(100 * torch.randn(shape, generator=garbage), 100 * torch.randn(shape, generator=garbage))
                 for _ in step.layers]
    step(torch.tensor([ids[:-1]], dtype=torch.int32), positions[:-1].view(1, -1),
         AttentionBatch(prefilled, slots[:-1], table, torch.tensor([length - 1], dtype=torch.int32),
                        is_decode=False, query_starts=[0, length - 1], context_lens=[0]))
    decode = lambda caches: AttentionBatch(caches, slots[-1:], table, torch.tensor([length], dtype=torch.int32),
                                           is_decode=True)
    got, new_rows = {}, {}
    for compiled in (False, True):
        step.compiled = compiled
        caches = [(k.clone(), v.clone()) for k, v in prefilled]
        assert step._runs_compiled(torch.zeros(1, 1), decode(caches)) == compiled
        got[compiled] = step(torch.tensor([[ids[-1]]], dtype=torch.int32), positions[-1:].view(1, 1), decode(caches))
        new_rows[compiled] = [c[table[0, (length - 1) // block_size].long(), :, (length - 1) % block_size]
                              for c in caches[0]]                 # the first layer's new key and value rows
    for eager_row, compiled_row in zip(new_rows[False], new_rows[True]):
        assert torch.allclose(compiled_row, eager_row, atol=1e-2, rtol=1e-2), (compiled_row - eager_row).abs().max()
    err = (got[True] - got[False]).abs().max().item()
    assert err < UNDECIDED_MARGIN, err


def test_a_failed_compile_leaves_the_step_eager(fp32, tokens, monkeypatch, caplog):
    """Where inductor cannot compile (no C++ compiler) the start-up warns and decode steps run the
    eager layers."""
    from models import cpu_llama

    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(cpu_llama, "compiled_decode_layer", fail)
    step = cpu_forward(fp32.model, fp32.gguf_path, "quantized", 512)
    shape = kernels.cache_shape(4, step.num_kv_heads, 16, step.head_dim)
    with caplog.at_level("WARNING", logger="models.cpu_llama"):
        assert step.warm_up([(torch.zeros(shape), torch.zeros(shape)) for _ in step.layers]) is None
    assert not step.compiled and "torch.compile failed (RuntimeError: no C++ compiler)" in caplog.text
    assert torch.isfinite(one_decode_step(step, tokens[:20])).all()
