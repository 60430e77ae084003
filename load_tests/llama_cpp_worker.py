"""llama.cpp's side of ``load_tests.cpu_bench``, run by the Python of the environment that has
llama-cpp-python (it imports nothing of this project). One JSON request per stdin line
``{"prompt": [ids], "new_tokens": n}``; one JSON answer per stdout line, greedy:

- ``first_s`` / ``rest_s``: wall seconds to the first token and from it to the last, with the
  same accounting as the other runners (the Python binding's per-call work included);
- ``prompt_eval_ms`` / ``eval_ms`` and their token counts: llama.cpp's own counters
  (``llama_perf_context``), the time spent in its decode calls, as ``llama-bench`` measures.

The prompt goes in as token ids, no BOS or template added. The next token is the argmax of the
last row of llama.cpp's logits (``llama_get_logits_ith``): the binding's ``scores`` array is only
filled with ``logits_all``.

    python load_tests/llama_cpp_worker.py MODEL.gguf THREADS
"""

import json
import sys
import time

import numpy as np
import llama_cpp
from llama_cpp import Llama


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    llm = Llama(model_path=path, n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    ctx = llm._ctx.ctx
    n_vocab = llm.n_vocab()

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        prompt, new_tokens = request["prompt"], request["new_tokens"]
        llm.reset()
        llama_cpp.llama_perf_context_reset(ctx)
        started = time.perf_counter()
        llm.eval(prompt)
        tokens = [next_token()]
        first = time.perf_counter()
        while len(tokens) < new_tokens:
            llm.eval(tokens[-1:])
            tokens.append(next_token())
        done = time.perf_counter()
        perf = llama_cpp.llama_perf_context(ctx)
        print(json.dumps({"first_s": first - started, "rest_s": done - first, "tokens": tokens,
                          "prompt_eval_ms": perf.t_p_eval_ms, "prompt_eval_tokens": perf.n_p_eval,
                          "eval_ms": perf.t_eval_ms, "eval_tokens": perf.n_eval}), flush=True)


if __name__ == "__main__":
    main()
