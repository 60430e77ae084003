"""CI without a GPU: every CUDA source compiles for sm_90 (a compile error fails CI, never skips).

Also keeps the split kernel free of register spills, which would cost it its bandwidth.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

from kernels.build import DEFINES

CSRC = Path(__file__).resolve().parent.parent / "kernels" / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))

# Kernels a source must instantiate (pieces of their mangled names, as ptxas -v lists its entry
# functions): the split kernel for both query types, the four (head_dim, warp) shapes and both
# cache types (the query's, int8); the quantising writes for both source types.
_SPLIT_SHAPES = ("Li64ELi32E", "Li64ELi16E", "Li128ELi16E", "Li256ELi16E")
REQUIRED_ENTRIES = {
    "flash_decode.cu": [f"split_kernelI{t}{shape}{kv}EEv" for t in ("13__nv_bfloat16", "6__half")
                        for shape in _SPLIT_SHAPES for kv in ("S2_", "a")],
    "write_kv.cu": ["write_kv_kernelE", "write_kv_int8_kernelI13__nv_bfloat16E", "write_kv_int8_kernelI6__halfE"],
    "layer_ops.cu": [f"rope_write_kv_kernelI{t}{kv}EEv" for t in ("13__nv_bfloat16", "6__half") for kv in ("S2_", "a")],
    # the prefill kernel for both query types, every head_dim and both cache types, and its merge
    "prefill.cu": [f"prefill_kernelI{t}Li{d}E{kv}EEv" for t in ("13__nv_bfloat16", "6__half") for d in (64, 128, 256)
                   for kv in ("S2_", "a")] + [f"merge_kernelI{t}Li{d}EEEv" for t in ("13__nv_bfloat16", "6__half")
                                              for d in (64, 128, 256)],
}


def nvcc() -> str:
    found = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).is_file()), None)
    assert found, "nvcc not found on PATH: CI must compile the CUDA sources"
    return found


def test_there_are_cuda_sources():
    assert SOURCES, f"no .cu files in {CSRC}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_for_sm90(source, tmp_path):
    includes = [f"-I{p}" for p in [*include_paths(), str(CSRC)]]
    # torch's extension flags too (no implicit half conversions): the JIT build compiles with them
    cmd = [nvcc(), "-arch=sm_90", "-O3", "-std=c++17", *COMMON_NVCC_FLAGS, *DEFINES, "-Xptxas", "-v", "-c", str(source),
           "-o", str(tmp_path / (source.stem + ".o")), *includes]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", result.stderr)]
    assert not any(spills), f"register spills in {source.name}:\n{result.stderr}"
    entries = re.findall(r"Compiling entry function '([^']+)'", result.stderr)
    missing = [name for name in REQUIRED_ENTRIES.get(source.name, []) if not any(name in e for e in entries)]
    assert not missing, f"{source.name} does not instantiate {missing}; it has {entries}"


def test_sources_refuse_to_build_without_the_shared_constants(tmp_path):
    source = CSRC / "write_kv.cu"
    cmd = [nvcc(), "-arch=sm_90", "-std=c++17", "-c", str(source), "-o", str(tmp_path / "x.o"), f"-I{CSRC}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "kernels/constants.py" in result.stderr + result.stdout


def test_every_source_file_is_at_most_500_lines():
    long = {p.name: n for p in CSRC.iterdir() if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these by concern: {long}"
