#!/usr/bin/env bash
# Everything that needs the GPU, in one command, logs under $OUT and a short table last.
#
#   OUT=results/gpu bash tests/gpu/run_on_device.sh [tests] [profile] [kernel-bench] [layer-bench] [engine-bench]
#       [http] [prefix] [prefix-engine] [tokenize] [window] [arch-tests] [arch] [int8] [structured]
#
# arch-tests: the GPU tests of the small architectures' presets (fused and transformers' layers
# against fp32) and of the layer ops they use. arch: load_tests.arch_bench over every preset
# (ARCH_PRESETS narrows it), B = 1 and 64, prompt 128, 256 new tokens; its table last.
#
# HTTP_WORKER_COUNTS="1 4" runs the HTTP load test once per API worker count (default: the server's auto).
# (Not FLASHDECODE_API_WORKERS: the server reads that one itself.) LOADGEN_WORKERS: client processes (default 8;
# at 256 streams 4 of them ran at about 90 % CPU each and set the pace).
# GPU_TESTS narrows the tests stage (pytest paths); KERNEL_BENCH_ARGS go to benchmarks.kernel_bench (both stages).
# int8: the int8 KV cache's GPU tests, its accuracy on the real SmolLM2 weights against the fp32
# model (every format), the kernel grid with an int8 column (B up to 256) and the engine's decode
# step alone with either cache; INT8_PARTS narrows it (default "tests accuracy kernel engine",
# about 8 minutes with the build on an H100).
# With no stage named, all run. On a host without the web stack, wheels in .whl/ are installed
# first.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/gpu}
source tests/gpu/script_env.sh
source tests/gpu/carried_wheels.sh
source tests/gpu/require_server_stack.sh
stages=${*:-tests profile kernel-bench layer-bench engine-bench http prefix prefix-engine tokenize window arch-tests arch int8 structured}
want() { [[ " $stages " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
stamp "building the kernel"
python3 -c "from kernels import ops; ops.load()" 2>&1 | tail -5 | tee "$OUT/build.log"

if want tests; then
  stamp "GPU tests"
  timeout 480 python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/gpu} -k "not test_architecture_" -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  summary+=("gpu tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/gpu_tests.log" | tail -1)")
fi
if want profile; then
  stamp "step profile"
  timeout 180 python3 -m load_tests.profile_steps --batch 1 16 256 --out "$OUT/profile" 2>&1 | tee "$OUT/profile.log" | tail -25
fi
if want kernel-bench; then
  stamp "kernel benchmark"
  timeout 420 python3 -m benchmarks.kernel_bench --out "$OUT" ${KERNEL_BENCH_ARGS:-} 2>&1 | tee "$OUT/kernel_bench.log" | tail -40
fi
if want layer-bench; then
  stamp "projection benchmark"
  timeout 200 python3 -m benchmarks.layer_ops_bench --out "$OUT" 2>&1 | tee "$OUT/layer_bench.log" | tail -40
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
  timeout "${PREFIX_TIMEOUT:-480}" bash tests/gpu/prefix_caching_bench.sh "$OUT/prefix" 2>&1 | tee "$OUT/prefix.log" | tail -40
  summary+=("prefix caching: see $OUT/prefix/summary.md")
fi
if want prefix-engine; then
  # the engine alone with prefix caching's workload: B streams kept busy, caching on and off taking turns
  for model in ${MODELS:-random:smollm2-135m random:llama-gqa128}; do
    stamp "prefix caching, engine alone: $model"
    timeout 220 python3 -m load_tests.engine_bench --device cuda --model "$model" --batch 1 16 64 --closed-loop 6 \
        --shared-prefix 2048 --prompt-len 128 --new-tokens 256 --prefix-caching on off --repeats 3 --num-blocks 16000 \
        --fill-pool --out "$OUT/prefix_engine_${model//[:\/]/_}.json" 2>&1 | grep "^|" | tee -a "$OUT/prefix_engine.md"
  done
  summary+=("prefix caching, engine alone: $OUT/prefix_engine.md")
fi
if want tokenize; then
  stamp "prompt encoding: whole against pieces (load_tests.tokenize_bench)"
  timeout 120 python3 -m load_tests.tokenize_bench --cases 0:128 0:2176 2048:128 --callers 1 4 16 2>&1 | tee "$OUT/tokenize.md"
  summary+=("prompt encoding: $OUT/tokenize.md")
fi
if want http; then
  engine_json=${ENGINE_JSON:-$OUT/engine_bench.json}
  for workers in ${HTTP_WORKER_COUNTS:-auto}; do
    stamp "HTTP load test, $workers API worker(s)"
    timeout 300 python3 -m load_tests.loadgen \
        --serve "--model random:smollm2-135m --device cuda --api-workers $workers" \
        --concurrency 1,16,64,256 --input-len 128 --output-len 256 --no-progress --workers ${LOADGEN_WORKERS:-8} \
        --engine-json "$engine_json" --out-dir "$OUT/http_w$workers" 2>&1 | tee "$OUT/http_w$workers.log" | tail -30
    grep -E "tok/s|ready|captured|HTTP on|not installed" "$OUT/http_w$workers/server.log" | tail -40
  done
fi
if want window; then
  # head_dim 256 (Gemma 3) and sliding windows: their GPU tests, then the kernel rows beside cuDNN
  # and a window of 512 against the unwindowed kernel.
  stamp "window: head_dim 256 and sliding-window tests"
  timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_window_cuda.py tests/gpu/test_flash_decode_cuda.py tests/gpu/test_layer_ops_cuda.py \
      -k "window or 256 or head-dim" -p no:cacheprovider -rs 2>&1 | tee "$OUT/window_tests.log" | tail -25
  summary+=("window tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/window_tests.log" | tail -1)")
  stamp "window: kernel rows (4/1/256 beside cuDNN; window 512 against unwindowed)"
  timeout 300 python3 -m benchmarks.kernel_bench --out "$OUT/window" --shapes 4/1/256 9/3/64 --batches 1 8 64 \
      --lengths 4096 32768 --window 512 2>&1 | tee "$OUT/window_bench.log" | tail -30
  summary+=("window bench ($OUT/window/bench.json):" "$(grep '^|' "$OUT/window_bench.log")")
fi
if want arch-tests; then
  stamp "architecture GPU tests"
  timeout 480 python3 -m pytest -q -s -m gpu -p no:cacheprovider -rs \
      "tests/gpu/test_engine_cuda.py::test_architecture_teacher_forced_logits_within_bf16_error_of_transformers" \
      tests/gpu/test_layer_ops_cuda.py 2>&1 | tee "$OUT/arch_tests.log" | grep -E "ours|FAILED|Error|passed|failed" | tail -40
  summary+=("arch tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/arch_tests.log" | tail -1)")
fi
if want arch; then
  stamp "architecture benchmark (load_tests.arch_bench)"
  timeout 560 python3 -m load_tests.arch_bench --device cuda ${ARCH_PRESETS:+--presets $ARCH_PRESETS} \
      --out "$OUT/arch" 2>&1 | tee "$OUT/arch_bench.log" | grep -v '^{' | grep -vE '^[0-9]{4}-' | tail -30
  summary+=("arch benchmark: $OUT/arch/arch_bench.md")
fi
if want int8; then
  parts=" ${INT8_PARTS:-tests accuracy kernel engine} "
  if [[ $parts == *" tests "* ]]; then
    stamp "int8 KV cache: GPU tests"
    timeout 180 python3 -m pytest -q -m gpu tests/gpu/test_kv_int8_cuda.py tests/gpu/test_read_kv_cuda.py \
        -p no:cacheprovider -rs 2>&1 | tee "$OUT/int8_tests.log" | tail -25
    summary+=("int8 tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/int8_tests.log" | tail -1)")
  fi
  if [[ $parts == *" accuracy "* ]]; then
    stamp "int8 KV cache: accuracy on SmolLM2-135M-Instruct against the fp32 model (teacher-forced, greedy Paris)"
    timeout 150 python3 -m load_tests.kv_accuracy --device cuda --out "$OUT/int8_accuracy.json" 2>&1 \
        | tee "$OUT/int8_accuracy.log" | grep -v -E '^(Loading|INFO)' | tail -18
    summary+=("int8 accuracy:" "$(grep -E '^\| [a-z0-9]' "$OUT/int8_accuracy.log")" "$(grep -E 'targets|TARGETS' "$OUT/int8_accuracy.log")")
  fi
  if [[ $parts == *" kernel "* ]]; then
    stamp "int8 KV cache: kernel grid, ours int8 vs ours bf16 vs cuDNN bf16"
    mkdir -p "$OUT/int8_kernel"
    timeout 170 python3 -m benchmarks.kernel_bench --int8 --peers cudnn --batches 1 8 64 256 --lengths 512 4096 32768 \
        --max-kv-mb 9000 --out "$OUT/int8_kernel" ${KERNEL_BENCH_ARGS:-} 2>&1 | tee "$OUT/int8_kernel_bench.log" | tail -40
    summary+=("int8 kernel on $(sed -n 2p "$OUT/gpu.txt" | cut -d, -f1):")
    while read -r line; do summary+=("$line"); done < <(sed -n '/^| shape | B | M | bf16 KV MB/,/^$/p' "$OUT/int8_kernel_bench.log")
    while read -r line; do summary+=("int8 kernel: $line"); done < <(grep -E '^(min|geomean) int8' "$OUT/int8_kernel_bench.log")
  fi
  if [[ $parts == *" engine "* ]]; then
    stamp "int8 KV cache: engine decode step alone, bf16 vs int8 cache"
    timeout 120 python3 -m load_tests.engine_bench --device cuda --model random:smollm2-135m --kv-cache-dtype auto int8 \
        --decode-step 8:32768 256:4096 1:128 --repeats 2 --out "$OUT/int8_decode_step.json" 2>&1 \
        | tee "$OUT/int8_decode_step.log" | grep -E '^\||decode step alone|KV pool' | tail -12
    while read -r line; do summary+=("int8 decode step: $line"); done < <(grep -E '^\| [0-9]' "$OUT/int8_decode_step.log")
  fi
fi
if want structured; then
  stamp "structured output: GPU test, then the engine with and without JSON schemas"
  timeout 300 python3 -m pytest -q tests/gpu/test_structured_cuda.py tests/gpu/test_grammar_argmax_cuda.py 2>&1 \
      | tee "$OUT/structured_tests.log" | tail -5
  timeout 90 python3 -m benchmarks.grammar_argmax_bench --out "$OUT" 2>&1 | tee "$OUT/grammar_argmax_bench.log" | tail -9
  timeout 480 python3 -m load_tests.structured_bench --device cuda --model random:smollm2-135m --batch 1 64 \
      --prompt-len 128 --new-tokens 256 --repeats 5 --out "$OUT/structured_bench.json" 2>&1 \
      | tee "$OUT/structured_bench.log" | grep -E '^\||structured output|first token' | tail -8
  while read -r line; do summary+=("structured: $line"); done < <(grep -E '^\| [0-9]|first token' "$OUT/structured_bench.log")
fi
stamp "done"
printf '%s\n' "${summary[@]}"
