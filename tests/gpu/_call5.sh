set -u
export PYTHONUNBUFFERED=1 FLASHDECODE_CACHE=/tmp/flashdecode-cache
export PYTHONPATH=$PWD; source tests/gpu/carried_wheels.sh
ROOT=$PWD; L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s); st(){ echo "[$(( $(date +%s)-t0 ))s] $*"; }
for tree in after before; do
  dir=$ROOT; [ $tree = before ] && dir=$ROOT/.before
  cd $dir; export PYTHONPATH=$dir:/tmp/site FLASHDECODE_CACHE=/tmp/fc-$tree
  st "$tree: build"; python3 -c "from kernels import ops; ops.load()" 2>&1 | tail -2
  st "$tree: engine"
  timeout 100 python3 -m load_tests.engine_bench --device cuda --model random:smollm2-135m --batch 1 64 --hf --repeats 2 --out $OUT/engine_$tree.json > $L/e_$tree.log 2>&1; grep -E '^\|' $L/e_$tree.log | tail -4
  st "$tree: prefix"
  timeout 100 python3 -m load_tests.engine_bench --device cuda --model random:smollm2-135m --batch 16 --shared-prefix 2048 --prefix-caching on --hf --repeats 2 --out $OUT/prefix_$tree.json > $L/p_$tree.log 2>&1; grep -E '^\||split|prefill' $L/p_$tree.log | tail -5
done
st done
