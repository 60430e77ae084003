# Sourced from the repository root by the GPU scripts: stops the script, in seconds, unless the
# server imports (a transformers outside pyproject's pin fails there) and has the HTTP stack a
# deployment runs (httptools, uvloop), which the server benchmarks measure.
python3 -c "import httptools, uvloop, server.cli" || {
  echo "the server's imports or its HTTP stack (httptools, uvloop) are missing; on a host without a" \
       "package index, carry their wheels in .whl/ (transformers within pyproject's pin)" >&2
  exit 1
}
