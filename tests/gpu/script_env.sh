# Sourced from the repository root by the GPU scripts, once OUT is set: creates $OUT, puts this
# checkout on PYTHONPATH (output unbuffered, the kernel build cached in FLASHDECODE_CACHE unless
# set), and defines summary (the table printed last) and stamp (a message after the seconds since
# this point).
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLASHDECODE_CACHE=${FLASHDECODE_CACHE:-/tmp/flashdecode-cache}
summary=()
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
