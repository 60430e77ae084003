#!/usr/bin/env bash
# The wheels the GPU scripts carry to a host without a package index, in three git-ignored folders
# so that a call carries only what it needs (64 MiB a call): .whl/ the web stack, .whl-xgr/
# xgrammar and what the structured-output tests import, .whl-router/ the SGLang Model Gateway.
#
#   bash tests/gpu/fetch_wheels.sh          # then carry .whl (and .whl-xgr / .whl-router) in the call
set -euo pipefail
cd "$(dirname "$0")/../.."
get() {  # DEST PACKAGE...
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_5_x86_64 -d "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
shared=../shared/gpu/fetch-wheels.sh
if [ -x "$shared" ] || [ -f "$shared" ]; then bash "$shared" .whl fastapi-offline; else
  get .whl fastapi fastapi-offline starlette pydantic pydantic-core uvicorn annotated-types annotated-doc \
    typing-inspection typing-extensions opentelemetry-api importlib-metadata sse-starlette gguf \
    "transformers>=5.17,<5.25" httptools uvloop filelock tokenizers
fi
get .whl aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl attrs   # the load generator's client
get .whl-xgr xgrammar==0.2.9 apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py attrs
get .whl-router sglang-router==0.3.2 setproctitle orjson
du -sh .whl .whl-xgr .whl-router
