"""Our engine as a worker process of ``load_tests.cpu_bench``, for an OpenMP setting the
benchmark's own process cannot take (OpenMP reads its environment once, at start-up). Same
protocol as ``llama_cpp_worker.py``: one JSON request per stdin line, one answer per stdout line.

    OMP_WAIT_POLICY=PASSIVE python -m load_tests.ours_worker MODEL quantized MAX_LEN
"""

import json
import logging
import sys

from models import load_model
from server.engine.threads import configure_cpu_threads

from .cpu_bench import Ours


def main() -> None:
    model, cpu_weights, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    logging.basicConfig(level=logging.WARNING)
    configure_cpu_threads()
    ours = Ours(load_model(model, dtype="float32", device="cpu"), cpu_weights, max_len)
    print(json.dumps({"ready": True, "version": None}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        first_s, rest_s, tokens = ours(request["prompt"], request["new_tokens"])
        print(json.dumps({"first_s": first_s, "rest_s": rest_s, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
