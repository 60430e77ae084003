"""Load a causal LM from any source with our attention wired in."""

import contextlib
import functools
import glob
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import gguf as gguf_package
import torch
from filelock import FileLock, Timeout
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import attention
from .gguf_rope import llama3_rope_parameters
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


COMPLETE_MARKER = ".complete"      # written last: a folder without it is not a finished conversion


def gguf_cache_folder(gguf: Path) -> Path:
    """Where ``gguf`` is converted to: a new copy or an edited file gets a folder of its own."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def converted_gguf_folder(gguf: Path) -> Path:
    """The GGUF converted once to a safetensors folder; later loads take seconds, not tens.

    One conversion per cache folder, whoever asks (the engine process, each API worker, another
    server on the same cache): the first takes a lock next to the folder and converts, the others
    wait on the lock and then find the folder finished. The conversion is written to a partial
    folder, marked complete and renamed into place, so a conversion killed midway leaves nothing
    that a later start takes for finished."""
    folder = gguf_cache_folder(gguf)
    if (folder / COMPLETE_MARKER).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder.with_name(folder.name + ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process to convert %s into %s", gguf.name, folder)
        lock.acquire()
    try:
        if (folder / COMPLETE_MARKER).is_file():   # converted while this process waited
            return folder
        _convert(gguf, folder)
    finally:
        lock.release()
    return folder


def _convert(gguf: Path, folder: Path) -> None:
    """Under the folder's lock: whatever an interrupted conversion left is removed first."""
    for stale in [folder, *folder.parent.glob(glob.escape(folder.name) + ".partial-*")]:
        if stale.exists():
            log.info("removing %s, left by an unfinished conversion", stale)
            shutil.rmtree(stale)
    started = time.monotonic()
    log.info("converting %s to safetensors in %s (once)", gguf.name, folder)
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    _write_checkpoint(gguf, partial)
    (partial / COMPLETE_MARKER).write_text(f"{gguf}\n")
    _fsync_tree(partial)
    partial.rename(folder)
    log.info("converted in %.1f s", time.monotonic() - started)


@contextlib.contextmanager
def _gguf_work_done_once():
    """transformers' GGUF loader parses the whole file (the tokenizer's ~100k strings: 3 s for the
    embedded model) once for the config, once for the weights and once for the tokenizer, and
    builds gguf's tensor-name map (a few ms) once per module of the model, ~400 times. Within this
    block each is made once: every ``gguf.GGUFReader`` of a path is the first one (they only
    read it), every ``gguf.get_tensor_name_map`` of an architecture and depth the first map."""
    make_reader, make_map = gguf_package.GGUFReader, gguf_package.get_tensor_name_map
    readers = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    gguf_package.GGUFReader, gguf_package.get_tensor_name_map = reader, functools.cache(make_map)
    try:
        yield reader
    finally:
        gguf_package.GGUFReader, gguf_package.get_tensor_name_map = make_reader, make_map


def _write_checkpoint(gguf: Path, folder: Path) -> None:
    with _gguf_work_done_once() as reader:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        rope = llama3_rope_parameters(reader(gguf), gguf.name, model.config) \
            if model.config.model_type == "llama" else None
    if rope is not None:
        log.info("%s: llama3 rope scaling %s, from its rope_freqs tensor", gguf.name, rope)
        model.config.rope_parameters = rope        # the saved config carries it; loading builds the rotary table
    # The weights are dequantized to float32 on load; what is saved is a plain checkpoint.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _fsync_tree(folder: Path) -> None:
    """The files and the folder on disk before the rename publishes them (a power cut after it
    must not leave a marked folder of empty files)."""
    for path in [*folder.iterdir(), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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


def prepare(spec: str = "default") -> Path | None:
    """Converts the GGUF that ``spec`` names into the cache (an image build does this, so that a
    container's first start loads in seconds); the folder, or None if ``spec`` needs no conversion."""
    source = resolve(spec)
    return converted_gguf_folder(source.path) if source.kind == "gguf" else None


if __name__ == "__main__":          # python -m models.loader [SPEC]: convert once, print the folder
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(prepare(sys.argv[1] if len(sys.argv) > 1 else "default"))
