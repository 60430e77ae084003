"""The fused decoder on each small architecture's preset (layers cut for speed) against
transformers' own forward, in float32 on the CPU: teacher-forced logits within 1e-4 through the
engine's prefill and decode steps, and greedy 32-token generations identical."""

import copy
import logging

import pytest
import torch

from models import FusedDecoder, fused_unsupported_reason, load_model
from models.presets import ARCHITECTURES
from server.engine import EngineConfig
from server.engine.model_runner import ModelRunner

from .helpers import perturb_small_tensors, runner_greedy, runner_teacher_forced

pytestmark = pytest.mark.slow

# Gemma 3 keeps six layers: five sliding-window ones and a global one.
CUT = {"gemma3-270m": 6}
TOLERANCE = 1e-4
MAX_LEN = 1024


def cut(preset: str) -> str:
    return f"random:{preset}@{CUT.get(preset, 2)}"


@pytest.fixture(scope="module", params=ARCHITECTURES)
def loaded(request):
    loaded = load_model(cut(request.param), dtype="float32", device="cpu")
    perturb_small_tensors(loaded.model, seed=1)
    assert fused_unsupported_reason(loaded.model) is None
    return loaded


@pytest.fixture(scope="module")
def reference(loaded):
    model = copy.deepcopy(loaded.model)
    model.set_attn_implementation("sdpa")
    return model


def make_runner(loaded, fused: bool) -> ModelRunner:
    runner = ModelRunner(loaded, EngineConfig(max_batch=2, num_blocks=80, block_size=16, fused_layers=fused,
                                              cpu_weights="float"), max_model_len=MAX_LEN)
    if fused and not isinstance(runner.forward, FusedDecoder):
        runner.forward = FusedDecoder(loaded.model, MAX_LEN)       # the Llama ones get the CPU step by default
    return runner


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_runner_picks_the_fused_decoder_off_the_llama_step(loaded, caplog):
    with caplog.at_level(logging.INFO, logger="server.engine.model_runner"):
        runner = ModelRunner(loaded, EngineConfig(max_batch=2, num_blocks=8, block_size=16, cpu_weights="float"),
                             max_model_len=MAX_LEN)
    if loaded.config.model_type == "llama":
        assert not isinstance(runner.forward, FusedDecoder), "Llama models keep the CPU step on the CPU"
    else:
        assert isinstance(runner.forward, FusedDecoder), caplog.text
        assert "decoder layers run fused" in caplog.text


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers-layers"])
@torch.inference_mode()
def test_teacher_forced_logits_match_transformers(loaded, reference, fused):
    # a model with sliding-window layers also runs a prompt past its window (Gemma 3's 512)
    prompt_lens = [40, 600] if getattr(loaded.config, "sliding_window", None) else [40]
    for prompt_len in prompt_lens:
        prompt, continuation = ids(prompt_len, 2), ids(32, 3)
        expected = reference(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1:-1].float()
        got = runner_teacher_forced(make_runner(loaded, fused), prompt, continuation)
        assert got.shape == expected.shape
        err = (got - expected).abs().max().item()
        assert err <= TOLERANCE, f"{loaded.name} fused={fused}, prompt {prompt_len}: max |logit error| {err:.2e} " \
                                 f"> {TOLERANCE} (|logits| up to {expected.abs().max():.2f})"


@torch.inference_mode()
def test_greedy_generation_identical_to_transformers(loaded, reference):
    prompt = ids(24, 4)
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
    expected = expected[0, len(prompt):].tolist()
    got = runner_greedy(make_runner(loaded, fused=True), prompt, 32)
    assert got == expected, f"{loaded.name}: first difference at {next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)}"


@pytest.mark.parametrize("change,reason", [
    (dict(mlp_bias=True), "MLP projections with bias"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not one of silu, gelu_pytorch_tanh"),
], ids=["mlp-bias", "gelu"])
def test_what_cannot_run_fused_runs_transformers_layers_and_the_log_says_why(change, reason, caplog):
    from dataclasses import replace
    from transformers import AutoModelForCausalLM

    from models.loader import LoadedModel
    from models.presets import preset_config

    base = load_model("random:tiny", dtype="float32", device="cpu")       # registers our attention too
    config = preset_config("tiny")
    for key, value in change.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=base.config._attn_implementation).eval()
    assert fused_unsupported_reason(model) == reason
    loaded = replace(base, model=model)
    assert isinstance(loaded, LoadedModel)
    with caplog.at_level(logging.INFO, logger="server.engine.model_runner"):
        runner = ModelRunner(loaded, EngineConfig(max_batch=2, num_blocks=8, block_size=16, cpu_weights="float"),
                             max_model_len=256)
    assert not isinstance(runner.forward, FusedDecoder)
    assert f"decoder layers run through transformers' modules ({reason})" in caplog.text
