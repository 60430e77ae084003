"""llama.cpp's side of ``load_tests.cpu_bench``, run by the Python of the environment that has
llama-cpp-python (it imports nothing of this project). One JSON request per stdin line
``{"prompt": [ids], "new_tokens": n}``; one JSON answer per stdout line with the seconds to the
first token and from it to the last, greedy, with the same accounting as the other runners.

    python load_tests/llama_cpp_worker.py MODEL.gguf THREADS
"""

import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    llm = Llama(model_path=path, n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    print(json.dumps({"ready": True, "version": __import__("llama_cpp").__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        prompt, new_tokens = request["prompt"], request["new_tokens"]
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        tokens = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
        first = time.perf_counter()
        while len(tokens) < new_tokens:
            llm.eval(tokens[-1:])
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        done = time.perf_counter()
        print(json.dumps({"first_s": first - started, "rest_s": done - first, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
