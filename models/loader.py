"""Load a causal LM from any source with our attention wired in."""

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import attention
from .presets import preset_config
from .sources import ModelSource, resolve

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object
    name: str
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    gguf_path: Path | None = None      # the file the weights came from, for the CPU's quantised step

    @property
    def config(self):
        return self.model.config

    @property
    def eos_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return {i for i in ids if i is not None}


def cache_root() -> Path:
    return Path(os.environ.get("FLASHDECODE_CACHE", Path.home() / ".cache" / "flashdecode"))


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not one of {', '.join(DTYPES)}")
    resolved = DTYPES[dtype]
    if device.type == "cpu" and resolved == torch.float16:
        raise ValueError("float16 is not supported on the CPU; use float32 or bfloat16")
    return resolved


def converted_gguf_folder(gguf: Path) -> Path:
    """The GGUF converted once to a safetensors folder; later loads take seconds, not tens."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    started = time.monotonic()
    log.info("converting %s to safetensors in %s (once)", gguf.name, folder)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantized to float32 on load; what is saved is a plain checkpoint.
    del model.config.quantization_config
    model.hf_quantizer = None
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    log.info("converted in %.1f s", time.monotonic() - started)
    return folder


# SmolLM2's tokenizer and chat template, shipped with the code so random presets need no weights.
PRESET_TOKENIZER = Path(__file__).parent / "tokenizer"


def _load_random(preset: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    config = preset_config(preset)
    config._attn_implementation = attention.NAME
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention.NAME)
    return model, AutoTokenizer.from_pretrained(PRESET_TOKENIZER)


def load_tokenizer(spec: str = "default"):
    """The tokenizer alone, for a process that serves HTTP while another holds the model."""
    source = resolve(spec)
    if source.kind == "random":
        return AutoTokenizer.from_pretrained(PRESET_TOKENIZER)
    folder = converted_gguf_folder(source.path) if source.kind == "gguf" else source.path
    return AutoTokenizer.from_pretrained(folder)


def load_model(spec: str = "default", dtype: str | None = None, device: str | torch.device = "cpu") -> LoadedModel:
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device)
    attention.register()
    source: ModelSource = resolve(spec)
    started = time.monotonic()
    if source.kind == "random":
        model, tokenizer = _load_random(source.preset, torch_dtype, device)
    else:
        folder = converted_gguf_folder(source.path) if source.kind == "gguf" else source.path
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation=attention.NAME)
        model.to(device)
    model.eval().requires_grad_(False)
    max_len = int(getattr(model.config, "max_position_embeddings", 2048))
    log.info("loaded %s (%s, %s) in %.1f s", source.name, torch_dtype, device, time.monotonic() - started)
    return LoadedModel(model, tokenizer, source.name, max_len, device, torch_dtype,
                       gguf_path=source.path if source.kind == "gguf" else None)
