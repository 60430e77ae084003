"""Our paged attention inside the real SmolLM2 against transformers' SDPA, in float32."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from models import load_model
from models.loader import converted_gguf_folder
from models.sources import embedded_gguf_path
from server.engine import Engine, EngineConfig, SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.model_runner import ModelRunner
from server.engine.sequence import Sequence

from .helpers import chat_ids, run_all

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
           "Explain in one paragraph why the sky is blue, then list three colours."]


@pytest.fixture(scope="module")
def ours():
    return load_model("default", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def sdpa_model():
    folder = converted_gguf_folder(embedded_gguf_path())
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def engine(ours):
    engine = Engine(ours, EngineConfig(max_batch=8, num_blocks=256, block_size=16, cpu_weights="float"))
    engine.start()
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("fused", [True, False], ids=["fused-layers", "transformers-layers"])
@torch.inference_mode()
def test_teacher_forced_logits_match_sdpa(ours, sdpa_model, fused):
    prompt = chat_ids(ours.tokenizer, PROMPTS[2])
    continuation = ours.tokenizer("The sky looks blue because air molecules scatter short blue wavelengths "
                                  "of sunlight far more than the longer red ones; this is Rayleigh scattering, "
                                  "and it is why sunsets look red and orange. Clouds are white because their "
                                  "droplets scatter every colour about equally, and the ocean looks blue partly "
                                  "because water absorbs red light. Snow is white for the same reason.")["input_ids"][:64]
    assert len(continuation) == 64
    full = torch.tensor([prompt + continuation])
    expected = sdpa_model(full).logits[0, len(prompt) - 1:-1]          # predicts each continuation token

    runner = ModelRunner(ours, EngineConfig(max_batch=4, num_blocks=32, block_size=16, fused_layers=fused,
                                            cpu_weights="float"),
                         max_model_len=512)
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seq = Sequence("tf", prompt, SamplingParams(), seed=0)
    blocks.grow(seq.block_table, seq.length)
    got = [runner.prefill([(seq, seq.length)])[0]]
    seq.num_cached = seq.length
    for token in continuation[:-1]:
        seq.append(token)
        blocks.grow(seq.block_table, seq.length)
        got.append(runner.decode([seq])[0])
        seq.num_cached = seq.length
    got = torch.stack(got)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_greedy_generations_identical_to_transformers(ours, sdpa_model, engine):
    new_tokens = 32
    requests = [(chat_ids(ours.tokenizer, p), SamplingParams(max_new_tokens=new_tokens)) for p in PROMPTS]
    results = run_all(engine, requests)
    for (prompt, _), (tokens, text, finish) in zip(requests, results):
        with torch.inference_mode():
            ref = sdpa_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
        expected = ref[0, len(prompt):].tolist()
        assert tokens == expected[:len(tokens)]
        assert len(tokens) == len(expected) or finish.reason == "eos"


def test_batched_prompts_of_different_lengths_match_alone(ours, engine):
    short = chat_ids(ours.tokenizer, "Hi!")
    long = chat_ids(ours.tokenizer, PROMPTS[2] + " Also mention the ocean, clouds and rainbows in detail.")
    assert len(long) >= len(short) + 20
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    together = run_all(engine, [(short, params), (long, params)])
    alone = [run_all(engine, [(p, params)])[0] for p in (short, long)]
    assert [t for t, _, _ in together] == [t for t, _, _ in alone]


def test_paris(ours, engine):
    (tokens, text, finish), = run_all(engine, [(chat_ids(ours.tokenizer, PROMPTS[0]), SamplingParams(max_new_tokens=16))])
    assert "Paris" in text and finish.text == text
