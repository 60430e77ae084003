"""``make bench-cpu LLAMA_CPP=1`` builds llama.cpp for the instruction sets the kernel enables
(/proc/cpuinfo), never with -march=native, which takes AMX from CPUID where the kernel has not
enabled it (SIGILL)."""

import subprocess
import sys
from pathlib import Path

from load_tests.llama_cpp_flags import cmake_args, cpu_flags

ROOT = Path(__file__).resolve().parents[1]
SAPPHIRE_RAPIDS_VM = ("fpu sse2 sse4_2 avx avx2 bmi2 fma f16c avx512f avx512cd avx512dq avx512bw avx512vl "
                      "avx512vbmi avx512_vnni avx512_bf16 avx_vnni")       # the kernel left amx_* out


def options(flags: str) -> dict[str, str]:
    cpuinfo = f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: sse2\n"
    return dict(arg.removeprefix("-D").split("=") for arg in cmake_args(cpu_flags(cpuinfo)))


def test_amx_only_where_the_kernel_lists_it():
    vm = options(SAPPHIRE_RAPIDS_VM)
    assert vm["GGML_NATIVE"] == "OFF"
    assert (vm["GGML_AMX_TILE"], vm["GGML_AMX_INT8"], vm["GGML_AMX_BF16"]) == ("OFF", "OFF", "OFF")
    assert all(vm[o] == "ON" for o in ("GGML_AVX2", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
                                       "GGML_AVX_VNNI", "GGML_FMA", "GGML_F16C"))
    host = options(SAPPHIRE_RAPIDS_VM + " amx_tile amx_int8 amx_bf16")
    assert (host["GGML_AMX_TILE"], host["GGML_AMX_INT8"], host["GGML_AMX_BF16"]) == ("ON", "ON", "ON")


def test_avx512_needs_every_subset_ggml_compiles_with():
    partial = options("sse2 sse4_2 avx avx2 fma f16c avx512f avx512cd")      # no VL/DQ/BW
    assert partial["GGML_AVX512"] == "OFF" and partial["GGML_AVX2"] == "ON"
    zen3 = options("sse2 sse4_2 avx avx2 bmi2 fma f16c")
    assert zen3["GGML_AVX512"] == zen3["GGML_AVX512_BF16"] == zen3["GGML_AVX_VNNI"] == "OFF"


def test_other_architectures_keep_the_native_build():
    assert cmake_args(cpu_flags("processor\t: 0\nFeatures\t: fp asimd sve\n")) == ["-DGGML_NATIVE=ON"]
    assert cmake_args(set()) == ["-DGGML_NATIVE=ON"]


def test_the_makefile_builds_with_these_flags(tmp_path):
    out = subprocess.run(["make", "-n", "bench-cpu", "LLAMA_CPP=1", f"VENV={tmp_path}/venv",
                          f"LLAMA_VENV={tmp_path}/llama"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    build = out[out.index("llama_cpp_flags.py"):]
    assert "GGML_NATIVE=ON" not in out and 'CMAKE_ARGS="$flags"' in build
    assert "--no-cache-dir" in build and "--no-binary llama-cpp-python" in build
    printed = subprocess.run([sys.executable, "load_tests/llama_cpp_flags.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert printed[0] in ("-DGGML_NATIVE=OFF", "-DGGML_NATIVE=ON") and len(printed) in (1, 15)
