# Sourced by the GPU scripts: on a host without the web stack, the wheels carried in .whl/ (and
# .whl-xgr/, .whl-router/ where carried) go to /tmp/site, which joins PYTHONPATH (the device image
# has no package index).
if [ -d .whl ] && ! python3 -c "import fastapi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl $(ls .whl-xgr/*.whl .whl-router/*.whl 2>/dev/null) || exit 1
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
fi
