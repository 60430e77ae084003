#!/usr/bin/env bash
# On the GPU host, from anywhere: build the extension, run the GPU tests, run the benchmark.
# Logs, bench.json and bench.png go to $OUT (default ./gpu_out); a short summary prints last.
# Knobs: PYTHON, BENCH_ARGS (e.g. --sweep), TEST_TIMEOUT, BENCH_TIMEOUT (seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export FLASHDECODE_CACHE=${FLASHDECODE_CACHE:-$HOME/.cache/flashdecode}
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

$PY - <<'EOF' 2>&1 | tee "$OUT/build.log"
import time
t = time.time()
from kernels import ops
ops.load()
print(f"build + load: {time.time() - t:.1f} s")
EOF
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  echo "BUILD FAILED (see build.log)"
  exit 1
fi

# A quick look before the long runs: a hang here (rc 124) means a pipeline deadlock; stop early.
timeout 120 $PY - <<'PYEOF' 2>&1 | tee "$OUT/smoke.log"
import torch, kernels
from kernels import ops
for dtype in (torch.bfloat16, torch.float16):
    for hq, hkv, d in ((9, 3, 64), (32, 8, 128)):
        for splits in (1, 5, None):
            for mode in (0, 1, 2):
                lens = [1, 100, 5000]
                k = torch.randn(3, hkv, 5000, d, device="cuda", dtype=dtype)
                v = torch.randn_like(k)
                kc, vc, bt = kernels.pack_paged(k, v, 32)
                sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
                q = torch.randn(3, hq, d, device="cuda", dtype=dtype)
                out = ops.flash_decode_cuda(q, kc, vc, bt, sl, num_splits=splits, merge_mode=mode)
                ref = kernels.reference_decode(q.float(), kc.float(), vc.float(), bt, sl, num_splits=1)
                err = (out.float() - ref).abs().max().item()
                print(f"smoke {dtype} {hq}/{hkv}/{d} splits={splits} merge={mode}: max err {err:.2e}",
                      "OK" if err < 3e-2 else "BAD")
PYEOF
if [ "${PIPESTATUS[0]}" -eq 124 ]; then
  echo "SMOKE TEST HUNG: stopping"
  exit 1
fi

timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -p no:cacheprovider -m gpu tests/gpu/test_flash_decode_cuda.py \
  -q -ra --durations=5 2>&1 | tee "$OUT/pytest.log"
test_rc=${PIPESTATUS[0]}

# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-300}" $PY -m kernels.bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo
echo "== summary (tests rc=$test_rc, bench rc=$bench_rc) =="
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
tail -n 1 "$OUT/pytest.log"
sed -n '/^| shape/,$p' "$OUT/bench.log"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
