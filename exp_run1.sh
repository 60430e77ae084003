python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site FLASHDECODE_CACHE=/tmp/fdc
python3 -c "from kernels import ops; ops.load()" 2>&1 | tail -2
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_flash_decode_cuda.py -p no:cacheprovider -k "one_trip or merge_modes or graph_replay or read_ahead" 2>&1 | tail -2
python3 -m kernels.bench --out $OUT --repeat 3 --only 9/3/64:1:32768 9/3/64:1:131072 9/3/64:8:4096 9/3/64:8:32768 9/3/64:8:131072 32/8/128:1:4096 32/8/128:1:32768 32/8/128:1:131072 --variant merge_one_trip=1 2>&1 | grep -E '^9/3|^32/8|against'
