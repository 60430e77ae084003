"""Just-in-time build of the CUDA extension (``csrc/``), cached on disk.

The first use compiles the sources of ``csrc/`` (``SOURCES``) with ninja through
``torch.utils.cpp_extension.load`` into ``$FLASHDECODE_CACHE`` (default ``~/.cache/flashdecode``),
one folder per torch/CUDA version; later processes load the cached library in well under a
second, and an edited source triggers a rebuild. The kernels use Hopper's bulk copies and
transaction barriers, so the build targets sm_90 (plus compute_90 PTX for newer chips); on
older GPUs (sm_80, sm_89) ``check_device`` refuses with a clear message.
"""

import os
import re
import shutil
from pathlib import Path

import torch

from .constants import nvcc_defines

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("flash_decode.cu", "write_kv.cu", "layer_ops.cu", "prefill.cu", "grammar_argmax.cu", "binding.cpp",
           "prefill_binding.cpp", "grammar_binding.cpp")
EXTENSION_NAME = "flashdecode_ext"
ARCH_FLAGS = ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]
DEFINES = nvcc_defines()    # the constants shared with Python (constants.py)
NVCC_FLAGS = ["-O3", "-lineinfo", *ARCH_FLAGS, *DEFINES]
CXX_FLAGS = ["-O3", *DEFINES]
# A host compiler that links its C++ runtime statically (the GPU image's /opt/gcc does) would
# otherwise export that copy's symbols, and the process binds some of them to the system
# libstdc++ that torch loaded: formatting a number in an error message then crashed. Hidden, the
# copy serves this library alone; with a shared runtime the flag changes nothing.
LD_FLAGS = ["-Wl,--exclude-libs,ALL"]
MIN_CAPABILITY = (9, 0)


class BuildError(RuntimeError):
    """The CUDA extension cannot be built or cannot run here."""


def cache_dir() -> Path:
    root = Path(os.environ.get("FLASHDECODE_CACHE") or Path.home() / ".cache" / "flashdecode")
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", f"torch{torch.__version__}-cuda{torch.version.cuda}")
    return root / tag


def find_nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME
    candidates = [Path(CUDA_HOME) / "bin" / "nvcc"] if CUDA_HOME else []
    found = shutil.which("nvcc")
    if found:
        candidates.append(Path(found))
    return next((str(c) for c in candidates if c.is_file()), None)


def check_toolchain(require_device: bool = True) -> None:
    if torch.version.cuda is None:
        raise BuildError(f"this torch ({torch.__version__}) has no CUDA support; the flash-decoding kernel "
                         "needs a CUDA build of torch (CPU tensors run kernels.reference_decode)")
    if require_device and not torch.cuda.is_available():
        raise BuildError("no CUDA device is visible; the flash-decoding kernel needs one "
                         "(CPU tensors run kernels.reference_decode)")
    if find_nvcc() is None:
        raise BuildError("nvcc not found (set CUDA_HOME or put the CUDA toolkit's bin/ on PATH); "
                         "it is needed once to build the kernel, which is then cached in " + str(cache_dir()))
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        raise BuildError("ninja not found: `pip install ninja` (torch builds the kernel with it)")


def check_device(device: torch.device) -> None:
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise BuildError(f"{name} is sm_{major}{minor}; the flash-decoding kernel needs sm_90 (Hopper) or newer "
                         "for its bulk copies and transaction barriers; sm_80/sm_89 are not supported "
                         "(CPU tensors run kernels.reference_decode)")


_loaded_path: str | None = None


def load_extension(verbose: bool = False, require_device: bool = True) -> str:
    """Build (first time) and load the library that registers ``torch.ops.flashdecode``.
    ``require_device=False`` builds where no GPU is visible (an image build, say)."""
    global _loaded_path
    if _loaded_path is None:
        check_toolchain(require_device)
        from torch.utils.cpp_extension import load
        build_dir = cache_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        load(name=EXTENSION_NAME, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=CXX_FLAGS,
             extra_cuda_cflags=NVCC_FLAGS, extra_ldflags=LD_FLAGS, extra_include_paths=[str(CSRC)],
             build_directory=str(build_dir), is_python_module=False, verbose=verbose)
        _loaded_path = str(build_dir)
    return _loaded_path


if __name__ == "__main__":
    # python -m kernels.build: compile into the cache now, no GPU needed (used by docker/Dockerfile).
    print("kernel built in", load_extension(verbose=True, require_device=False))
