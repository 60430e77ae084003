set -u
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for c in "9/3/64 64 4096" "9/3/64 8 32768"; do
  set -- $c
  for who in "--peer cudnn" ""; do
    log="$OUT/ncu_${1//\//_}_b$2_m$3${who:+_cudnn}.txt"
    timeout 150 "$ncu" --clock-control none --profile-from-start off --launch-skip 6 --launch-count 2 \
      --section LaunchStats --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis \
      python3 -m kernels.profile_case --shape "$1" --batch "$2" --seq-len "$3" --calls 12 $who > "$log" 2>&1
    echo "== $c $who (rc $?)"
    grep -E "^  [a-zA-Z_].*\(|Duration|Grid Size|Block Size|Registers Per|Shared Memory Config|Dynamic Shared|Static Shared|Waves Per SM|DRAM Throughput|Achieved Occupancy|Theoretical Occ|Mem Busy|Max Bandwidth|L2 Hit|==ERROR==" "$log" | cut -c1-150 | head -40
  done
done
