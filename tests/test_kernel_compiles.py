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


def test_sources_refuse_to_build_without_the_shared_constants(tmp_path):
    source = CSRC / "write_kv.cu"
    cmd = [nvcc(), "-arch=sm_90", "-std=c++17", "-c", str(source), "-o", str(tmp_path / "x.o"), f"-I{CSRC}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "kernels/constants.py" in result.stderr + result.stdout


def test_every_source_file_is_at_most_500_lines():
    long = {p.name: n for p in CSRC.iterdir() if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these by concern: {long}"
