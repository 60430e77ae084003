#!/usr/bin/env bash
# Nsight Compute's warp-state and throughput sections for a few kernel cases, and the split
# kernel's SASS, under $OUT:  OUT=results/prof bash tests/gpu/profile_kernel.sh
# With "peers": launch, occupancy and memory sections of ours and of cuDNN's kernels (SDPA) for
# the two 201 MB head_dim-64 cases instead:  OUT=results/prof bash tests/gpu/profile_kernel.sh peers
# (On a host without the web stack, wheels in .whl/ are installed first, as run_on_device.sh does.)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/prof}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} FLASHDECODE_CACHE=${FLASHDECODE_CACHE:-/tmp/flashdecode-cache}
python3 -c "from kernels import ops; ops.load()" 2>&1 | tail -2
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ "${1:-}" = peers ]; then
  for c in "9/3/64 64 4096" "9/3/64 8 32768"; do
    set -- $c
    for who in "--peer cudnn" ""; do
      log="$OUT/ncu_${1//\//_}_b$2_m$3${who:+_cudnn}.txt"
      timeout 150 "$ncu" --clock-control none --profile-from-start off --launch-skip 6 --launch-count 2 \
          --section LaunchStats --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis \
          python3 -m benchmarks.profile_case --shape "$1" --batch "$2" --seq-len "$3" --calls 12 $who > "$log" 2>&1
      echo "== $c $who (rc $?)"
      grep -E "^  [a-zA-Z_].*\(|Duration|Grid Size|Block Size|Registers Per|Dynamic Shared|Static Shared|Waves Per SM|DRAM Throughput|Achieved Occupancy|Theoretical Occ|Mem Busy|==ERROR==" "$log" \
          | cut -c1-150 | head -40
    done
  done
  exit 0
fi
cuobjdump --dump-sass "$(ls "$FLASHDECODE_CACHE"/*/flashdecode_ext.so | head -1)" > "$OUT/sass.txt"
for c in "9/3/64 8 4096" "9/3/64 1 32768" "32/8/128 8 4096" "9/3/64 64 4096"; do
  set -- $c
  log="$OUT/ncu_${1//\//_}_b$2_m$3.txt"
  timeout 120 "$ncu" --clock-control none --kernel-name regex:split_kernel --launch-skip 6 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      python3 -m benchmarks.profile_case --shape "$1" --batch "$2" --seq-len "$3" > "$log" 2>&1
  echo "== $c (rc $?)"
  grep -E "Duration|stalled|Warp Cycles Per Issued|Issued Warp|No Eligible|Achieved Active Warps|DRAM Throughput|==ERROR==" "$log" \
      | awk '!/stalled/ || $NF+0 >= 0.05' | head -30
done
