"""Each small architecture loads through the server's model sources: a Hugging Face folder
(config.json, safetensors, tokenizer with its chat template) and a .gguf file (transformers' GGUF
loader supports all four families), the weights arriving intact and the fused decoder serving them."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models import FusedDecoder, fused_unsupported_reason, load_model
from models.loader import PRESET_TOKENIZER
from models.presets import ARCHITECTURES, preset_config
from models.sources import resolve
from server.generation import _render_chat

from .gguf_files import write_gguf
from .helpers import perturb_small_tensors

pytestmark = pytest.mark.slow

# A template no preset ships, so the test sees that the folder's own template is the one used.
CHAT_TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}<</{{ m['role'] }}>>{% endfor %}"
                 "{% if add_generation_prompt %}<<assistant>>{% endif %}")


def small_model(preset: str):
    """The preset's architecture with one layer (Gemma 3: its first six, both layer types) and the
    tokenizer's vocabulary, norm weights and biases randomised."""
    config = preset_config(f"{preset}@{6 if preset.startswith('gemma3') else 1}")
    config.vocab_size = 49152
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb_small_tensors(model, seed=3)
    return model


def same_logits(loaded, model):
    ids = torch.randint(10, 49000, (1, 40), generator=torch.Generator().manual_seed(5))
    reference = model.float()
    reference.set_attn_implementation("sdpa")
    with torch.inference_mode():
        expected = reference(ids).logits
        loaded.model.set_attn_implementation("sdpa")
        got = loaded.model(ids).logits
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("preset", ARCHITECTURES)
def test_hugging_face_folder(preset, tmp_path):
    model = small_model(preset)
    model.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(PRESET_TOKENIZER)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    assert resolve(str(tmp_path)).kind == "hf"

    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert loaded.config.model_type == model.config.model_type
    assert fused_unsupported_reason(loaded.model) is None
    FusedDecoder(loaded.model, 256)
    assert _render_chat(loaded.tokenizer, [{"role": "user", "content": "hi"}]) == "<<user>>hi<</user>><<assistant>>"
    err = same_logits(loaded, model)
    assert err <= 1e-5, f"{preset}: logits of the reloaded folder differ by {err:.2e}"


@pytest.mark.parametrize("preset", ARCHITECTURES)
def test_gguf_file(preset, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHDECODE_CACHE", str(tmp_path / "cache"))
    model = small_model(preset)
    path = write_gguf(model, tmp_path / f"{preset}.gguf")
    assert resolve(str(path)).kind == "gguf"

    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert loaded.config.model_type == model.config.model_type
    assert fused_unsupported_reason(loaded.model) is None
    FusedDecoder(loaded.model, 256)
    assert "<|im_start|>" in _render_chat(loaded.tokenizer, [{"role": "user", "content": "hi"}])
    err = same_logits(loaded, model)
    assert err <= 1e-5, f"{preset}: logits of the model read from GGUF differ by {err:.2e}"
