#!/usr/bin/env bash
# The split-KV prefill kernel on the GPU, in one command: build the extension, its GPU tests, the
# engine with the kernel forced on (tests/gpu/test_prefill_choice_cuda.py), the decode kernel's GPU
# tests beside them (nothing else broken or slower), then the prefill benchmark
# against the engine's way today (read_kv + FlashAttention varlen), FA alone and cuDNN. Logs under
# $OUT; the short table last.
#
#   OUT=results/prefill bash tests/gpu/prefill_kernel.sh
#
# PREFILL_BENCH_ARGS go to benchmarks.prefill_bench (e.g. "--int8", "--batches 1 16").
# SKIP_DECODE_BENCH=1 leaves out the decode kernel grid (benchmarks.kernel_bench --quick).
# SANITIZE=1 runs one small case under compute-sanitizer (memcheck, racecheck) even when the tests pass.
# TESTS_ONLY=1 stops after the prefill and engine tests (and the sanitizer): the correctness check alone.
# The benchmark writes the engine's per-shape table to $OUT/prefill_table.json (the repository's
# kernels/prefill_table.json with this GPU's cases added): copy it to kernels/prefill_table.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/prefill}
source tests/gpu/script_env.sh

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
git log -1 --oneline | tee "$OUT/commit.txt"
stamp "building the kernel"
python3 -c "from kernels import ops; ops.load()" 2>&1 | tail -20 | tee "$OUT/build.log"
if ! python3 -c "from kernels import ops; ops.load(); import torch; assert hasattr(torch.ops.flashdecode, 'flash_prefill')"; then
  echo "BUILD FAILED: see $OUT/build.log"; exit 1
fi

stamp "prefill GPU tests"
timeout 900 python3 -m pytest -q -m gpu tests/gpu/test_flash_prefill_cuda.py -p no:cacheprovider -rs --maxfail=5 \
    2>&1 | tee "$OUT/prefill_tests.log" | tail -30
summary+=("prefill tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/prefill_tests.log" | tail -1)")
if [[ -n ${SANITIZE:-} ]] || grep -qE 'failed|error' "$OUT/prefill_tests.log"; then
  # one small case under compute-sanitizer: out-of-bounds accesses, then shared-memory races
  for tool in memcheck racecheck; do
    stamp "compute-sanitizer $tool on one small prefill case"
    timeout 300 compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/gpu/test_flash_prefill_cuda.py -k "first_tokens" 2>&1 | tee "$OUT/sanitizer_$tool.log" | tail -15
    summary+=("compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)")
  done
fi

stamp "the engine with the kernel forced for every shape, against FlashAttention (eager prefill steps)"
timeout 600 python3 -m pytest -q -m gpu tests/gpu/test_prefill_choice_cuda.py -p no:cacheprovider -rs \
    2>&1 | tee "$OUT/prefill_choice_tests.log" | tail -15
summary+=("engine with the kernel forced: $(grep -E '[0-9]+ (passed|failed)' "$OUT/prefill_choice_tests.log" | tail -1)")

if [[ -n ${TESTS_ONLY:-} ]]; then
  printf '%s\n' "${summary[@]}"
  exit 0
fi

stamp "decode GPU tests (unchanged kernel, shared merge)"
timeout 600 python3 -m pytest -q -m gpu tests/gpu/test_flash_decode_cuda.py tests/gpu/test_kv_int8_cuda.py \
    tests/gpu/test_read_kv_cuda.py tests/gpu/test_window_cuda.py -p no:cacheprovider -rs \
    2>&1 | tee "$OUT/decode_tests.log" | tail -15
summary+=("decode tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/decode_tests.log" | tail -1)")

if [[ -z ${SKIP_DECODE_BENCH:-} ]]; then
  stamp "decode kernel grid (compare with benchmarks/results/ on the same card)"
  timeout 420 python3 -m benchmarks.kernel_bench --quick --out "$OUT/decode" 2>&1 | tee "$OUT/decode_bench.log" | tail -25
  while read -r line; do summary+=("decode: $line"); done < <(grep -E '^(min|geomean)' "$OUT/decode_bench.log")
fi

stamp "prefill benchmark"
if [[ -f kernels/prefill_table.json ]]; then cp kernels/prefill_table.json "$OUT/prefill_table.json"; fi
timeout 1200 python3 -m benchmarks.prefill_bench --out "$OUT" --write-table "$OUT/prefill_table.json" \
    ${PREFILL_BENCH_ARGS:-} 2>&1 | tee "$OUT/prefill_bench.log" | tail -70
stamp "done"
summary+=("$(grep -E '^prefill table' "$OUT/prefill_bench.log" || echo "prefill table: not written")")
printf '%s\n' "${summary[@]}"
echo
sed -n '/^| shape/,$p' "$OUT/prefill_bench.log"
