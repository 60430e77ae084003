#!/usr/bin/env bash
# Everything that needs the GPU, in one command, logs under $OUT and a short table last.
#
#   OUT=results/gpu bash tests/gpu/run_on_device.sh [tests] [profile] [kernel-bench] [layer-bench] [engine-bench]
#       [http] [prefix] [fp8]
#
# HTTP_WORKER_COUNTS="1 4" runs the HTTP load test once per API worker count (default: the server's auto).
# (Not API_WORKERS: the server reads that one itself.) LOADGEN_WORKERS: client processes (default 8;
# at 256 streams 4 of them ran at about 90 % CPU each and set the pace).
# GPU_TESTS narrows the tests stage (pytest paths); KERNEL_BENCH_ARGS go to kernels.bench (both stages).
# fp8: the fp8 KV cache's GPU tests, its accuracy on the real SmolLM2 weights, the kernel grid with
# an fp8 column and the engine's decode step alone with either cache.
# With no stage named, all run. On a host without the web stack, wheels in .whl/ are installed
# first (see the README's GPU section).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLASHDECODE_CACHE=${FLASHDECODE_CACHE:-/tmp/flashdecode-cache}
if [ -d .whl ] && ! python3 -c "import fastapi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
stages=${*:-tests profile kernel-bench layer-bench engine-bench http prefix fp8}
want() { [[ " $stages " == *" $1 "* ]]; }
summary=()
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
stamp "building the kernel"
python3 -c "from kernels import ops; ops.load()" 2>&1 | tail -5 | tee "$OUT/build.log"

if want tests; then
  stamp "GPU tests"
  timeout 200 python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/gpu} -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  summary+=("gpu tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/gpu_tests.log" | tail -1)")
fi
if want profile; then
  stamp "step profile"
  timeout 180 python3 -m load_tests.profile_steps --batch 1 16 256 --out "$OUT/profile" 2>&1 | tee "$OUT/profile.log" | tail -25
fi
if want kernel-bench; then
  stamp "kernel benchmark"
  timeout 300 python3 -m kernels.bench --out "$OUT" ${KERNEL_BENCH_ARGS:-} 2>&1 | tee "$OUT/kernel_bench.log" | tail -40
fi
if want layer-bench; then
  stamp "projection benchmark"
  timeout 200 python3 -m kernels.bench_layer_ops --out "$OUT" 2>&1 | tee "$OUT/layer_bench.log" | tail -40
fi
if want engine-bench; then
  stamp "engine benchmark"
  timeout 420 python3 -m load_tests.engine_bench --device cuda --model random:smollm2-135m \
      --batch 1 16 64 256 --long-batch 1 8 --hf ${HF-default static} --hf-long ${HF_LONG-default} --repeats 1 \
      --out "$OUT/engine_bench.json" 2>&1 | tee "$OUT/engine_bench.log" | grep -v '^{' | tail -30
  cp "$OUT/engine_bench.json" /tmp/engine_bench.json 2>/dev/null
fi
if want prefix; then
  stamp "prefix caching on and off (tests/gpu/prefix_caching_bench.sh)"
  timeout 480 bash tests/gpu/prefix_caching_bench.sh "$OUT/prefix" 2>&1 | tee "$OUT/prefix.log" | tail -40
  summary+=("prefix caching: see $OUT/prefix/summary.md")
fi
if want http; then
  engine_json=${ENGINE_JSON:-$OUT/engine_bench.json}
  for workers in ${HTTP_WORKER_COUNTS:-auto}; do
    stamp "HTTP load test, $workers API worker(s)"
    timeout 300 python3 -m load_tests.loadgen \
        --serve "--model random:smollm2-135m --device cuda --api-workers $workers" \
        --concurrency 1,16,64,256 --input-len 128 --output-len 256 --no-progress --workers ${LOADGEN_WORKERS:-8} \
        --engine-json "$engine_json" --out-dir "$OUT/http_w$workers" 2>&1 | tee "$OUT/http_w$workers.log" | tail -30
    grep -E "tok/s|ready|captured" "$OUT/http_w$workers/server.log" | tail -40
  done
fi
if want fp8; then
  stamp "fp8 KV cache: GPU tests"
  timeout 400 python3 -m pytest -q -m gpu tests/gpu/test_kv_fp8_cuda.py -p no:cacheprovider -rs 2>&1 \
      | tee "$OUT/fp8_tests.log" | tail -25
  summary+=("fp8 tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/fp8_tests.log" | tail -1)")
  stamp "fp8 KV cache: accuracy on SmolLM2-135M-Instruct (teacher-forced, greedy Paris)"
  timeout 300 python3 -m load_tests.kv_accuracy --device cuda --out "$OUT/fp8_accuracy.json" 2>&1 \
      | tee "$OUT/fp8_accuracy.log" | grep -v INFO | tail -8
  summary+=("fp8 accuracy: $(grep -E 'agreement' "$OUT/fp8_accuracy.log" | tail -1) /$(grep -E 'mean KL' "$OUT/fp8_accuracy.log" | tail -1) /$(grep -E 'targets' "$OUT/fp8_accuracy.log" | tail -1)")
  stamp "fp8 KV cache: kernel grid, ours fp8 vs ours bf16 vs cuDNN bf16"
  mkdir -p "$OUT/fp8_kernel"
  timeout 480 python3 -m kernels.bench --fp8 --peers cudnn --out "$OUT/fp8_kernel" ${KERNEL_BENCH_ARGS:-} 2>&1 \
      | tee "$OUT/fp8_kernel_bench.log" | tail -36
  while read -r line; do summary+=("fp8 kernel: $line"); done < <(grep -E '^(min|geomean) fp8' "$OUT/fp8_kernel_bench.log")
  stamp "fp8 KV cache: engine decode step alone, bf16 vs fp8 cache"
  timeout 420 python3 -m load_tests.engine_bench --device cuda --model random:smollm2-135m --kv-cache-dtype auto fp8 \
      --decode-step 8:32768 256:4096 1:128 --repeats 3 --out "$OUT/fp8_decode_step.json" 2>&1 \
      | tee "$OUT/fp8_decode_step.log" | grep -E '^\||decode step alone|KV pool|scales' | tail -12
  while read -r line; do summary+=("fp8 decode step: $line"); done < <(grep -E '^\| [0-9]' "$OUT/fp8_decode_step.log")
fi
stamp "done"
printf '%s\n' "${summary[@]}"
