"""The CMake flags that build llama.cpp (``make bench-cpu LLAMA_CPP=1``) for this CPU as the kernel
lets programs use it: one flag per instruction set named in /proc/cpuinfo, with GGML_NATIVE off.

GGML_NATIVE=ON compiles with -march=native, which reads CPUID: a virtual machine's CPU may report
AMX there while its kernel has not enabled the tile state (then /proc/cpuinfo leaves amx_* out), and
llama.cpp built so dies of SIGILL at its first matrix product. Where /proc/cpuinfo lists no x86
flags (another architecture, another system) the native build stays.

    python3 load_tests/llama_cpp_flags.py            # prints the flags for CMAKE_ARGS
"""

import sys
from pathlib import Path

# ggml's option: the /proc/cpuinfo flags it needs (GGML_AVX512 compiles with F, CD, VL, DQ and BW)
GGML_OPTIONS = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
    "GGML_AMX_TILE": ("amx_tile",),
    "GGML_AMX_INT8": ("amx_tile", "amx_int8"),
    "GGML_AMX_BF16": ("amx_tile", "amx_bf16"),
}


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor listed."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cmake_args(flags: set[str]) -> list[str]:
    if "sse2" not in flags:                      # not an x86 CPU as the kernel describes it
        return ["-DGGML_NATIVE=ON"]
    args = ["-DGGML_NATIVE=OFF"]
    for option, needed in GGML_OPTIONS.items():
        args.append(f"-D{option}={'ON' if all(f in flags for f in needed) else 'OFF'}")
    return args


def main() -> int:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    print(" ".join(cmake_args(cpu_flags(cpuinfo))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
