"""CPU benchmark at batch 1: our engine, transformers' ``generate`` and llama.cpp on the same GGUF.

Every runner gets the same random prompt (a new one each run, so that our prefix cache serves
none of it), generates greedily to the full length and is timed the same way: prefill tokens/s
is the prompt's length over the time to the first generated token, decode tokens/s the remaining
tokens over the time from the first to the last. The runners take turns, run after run, so load from other processes on the machine hits them all
alike; medians over the runs are reported. Ours runs on the file's quantised weights and on
its float (dequantised) weights; transformers on the dequantised float32 weights; llama.cpp
(``--llama-python``, the Python of an environment with llama-cpp-python, ``make bench-cpu
LLAMA_CPP=1``) in a worker process on the file itself. Every runner uses the same threads and
OpenMP's default wait (threads spin a few ms before sleeping), as the server and llama.cpp run;
``ours_quantized_passive`` is our engine in a worker process with ``OMP_WAIT_POLICY=PASSIVE``
(idle threads sleep at once), the setting for a host shared with busy processes. llama.cpp's own counters
(``llama_perf_context``: the time inside its decode calls, as ``llama-bench`` counts) are a row
of their own and the baseline of the ratios.

    python -m load_tests.cpu_bench --repeats 3 --out results/cpu_bench.json
    python -m load_tests.cpu_bench --llama-python .cache/llama-venv/bin/python
"""

import argparse
import copy
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from models import load_model  # noqa: E402
from server.engine import EngineConfig, EngineCore, SamplingParams, TokenEvent  # noqa: E402
from server.engine.threads import configure_cpu_threads  # noqa: E402

WORKER = Path(__file__).with_name("llama_cpp_worker.py")
LLAMA_COUNTERS = "llama_cpp (its perf counters)"   # the time inside llama.cpp's decode calls


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (length,), generator=g).tolist()


class Ours:
    def __init__(self, loaded, cpu_weights: str, max_len: int):
        config = EngineConfig(max_batch=1, max_model_len=max_len, num_blocks=-(-max_len // 128) + 1,
                              cpu_weights=cpu_weights)
        self.core = EngineCore(loaded, config, publish=self._publish)
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.runs = 0

    def _publish(self, pairs, stats) -> None:
        for _, event in pairs:
            if type(event) is TokenEvent:
                self.times.append(time.perf_counter())
                self.tokens.append(event.token_id)

    def __call__(self, prompt, new_tokens):
        self.times, self.tokens = [], []
        self.runs += 1
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        started = time.perf_counter()
        self.core.add(f"bench-{self.runs}", prompt, params, seed=0)
        self.core.run_until_idle()
        assert len(self.tokens) == new_tokens, len(self.tokens)
        return self.times[0] - started, self.times[-1] - self.times[0], self.tokens


class _Stamps(BaseStreamer):
    """Times of generate's outputs: the prompt first, then each new token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


class HfGenerate:
    def __init__(self, model):
        self.model = model
        self.threads = torch.get_num_threads()

    def __call__(self, prompt, new_tokens):
        torch.set_num_threads(self.threads)       # our engine leaves one where its decode steps chose one
        ids = torch.tensor([prompt])
        stamps = _Stamps()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=stamps)
        generated = out[0, len(prompt):].tolist()
        assert len(generated) == new_tokens and len(stamps.times) == new_tokens + 1
        return stamps.times[1] - started, stamps.times[-1] - stamps.times[1], generated


class Worker:
    """A runner in a process of its own, ``python ...`` speaking one JSON line each way."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=Path(__file__).parent.parent)
        self.version = self._read()["version"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker {self.proc.args} exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, prompt, new_tokens) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def __call__(self, prompt, new_tokens):
        answer = self.ask(prompt, new_tokens)
        return answer["first_s"], answer["rest_s"], answer["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def default_openmp_env() -> dict[str, str]:
    """This environment without an OpenMP wait policy: OpenMP's default (threads spin a few ms
    at each wait, then sleep), as llama.cpp and its llama-bench run. llama.cpp's CPU backend
    (built with OpenMP) waits at an OpenMP barrier after every op of its graph, so a passive
    pool costs it a wake-up per op."""
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def passive_openmp_env() -> dict[str, str]:
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


class LlamaCpp(Worker):
    def __init__(self, python: str, gguf: Path, threads: int):
        super().__init__([python, str(WORKER), str(gguf), str(threads)], default_openmp_env())

    def __call__(self, prompt, new_tokens):
        answer = self.ask(prompt, new_tokens)
        if answer["prompt_eval_tokens"] != len(prompt) or answer["eval_tokens"] != new_tokens - 1:
            raise RuntimeError(f"llama.cpp counted {answer['prompt_eval_tokens']} prompt and {answer['eval_tokens']} "
                               f"decode tokens, not {len(prompt)} and {new_tokens - 1}")
        self.counters = answer["prompt_eval_ms"] / 1e3, answer["eval_ms"] / 1e3
        return answer["first_s"], answer["rest_s"], answer["tokens"]


def llama_bench(binary: str, gguf: Path, threads: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """llama.cpp's own benchmark binary on the same file: prefill (pp) and decode (tg) tokens/s."""
    out = subprocess.run([binary, "-m", str(gguf), "-p", str(prompt_len), "-n", str(new_tokens), "-t", str(threads),
                          "-r", str(repeats), "-o", "json"], check=True, capture_output=True, text=True).stdout
    rows = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in json.loads(out)}
    return {"llama-bench": {"prefill_tok_per_s": rows["pp"], "decode_tok_per_s": rows["tg"]}}


def common_prefix(a: list[int], b: list[int]) -> int:
    """Leading greedy tokens two runners agree on (after one differs, the continuations do too)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def rates(prefill_s: float, decode_s: float, prompt_len: int, new_tokens: int) -> dict:
    return {"prefill_tok_per_s": prompt_len / prefill_s, "decode_tok_per_s": (new_tokens - 1) / decode_s}


def markdown(summary: dict, baseline: str | None) -> str:
    lines = ["| runner | prefill tok/s | decode tok/s |" + (f" prefill / {baseline} | decode / {baseline} |" if baseline else ""),
             "|---|---|---|" + ("---|---|" if baseline else "")]
    for name, row in summary.items():
        line = f"| {name} | {row['prefill_tok_per_s']:.1f} | {row['decode_tok_per_s']:.1f} |"
        if baseline:
            base = summary[baseline]
            line += (f" {row['prefill_tok_per_s'] / base['prefill_tok_per_s']:.2f}x |"
                     f" {row['decode_tok_per_s'] / base['decode_tok_per_s']:.2f}x |")
        lines.append(line)
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="a .gguf file or 'default' (the embedded one)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runners", nargs="+",
                    default=["ours_quantized", "ours_quantized_passive", "ours_float", "hf_generate", "llama_cpp"],
                    choices=["ours_quantized", "ours_quantized_passive", "ours_float", "hf_generate", "llama_cpp"])
    ap.add_argument("--llama-python", default=None,
                    help="Python of an environment with llama-cpp-python (without it llama.cpp is left out)")
    ap.add_argument("--llama-bench", default=None, help="a llama-bench binary of llama.cpp, run on the same file too")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 2:
        ap.error("--repeats must be at least 1 and --new-tokens at least 2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    threads = configure_cpu_threads()
    loaded = load_model(args.model, dtype="float32", device="cpu")
    if loaded.gguf_path is None:
        ap.error(f"--model {args.model!r} is not a GGUF file")
    max_len = args.prompt_len + args.new_tokens + 8
    runners = {}
    for name in args.runners:
        if name == "ours_quantized":
            runners[name] = Ours(loaded, "quantized", max_len)
        elif name == "ours_quantized_passive":                            # idle OpenMP threads sleep at once
            runners[name] = Worker([sys.executable, "-m", "load_tests.ours_worker", args.model, "quantized",
                                    str(max_len)],
                                   passive_openmp_env())
        elif name == "ours_float":
            runners[name] = Ours(loaded, "float", max_len)
        elif name == "hf_generate":
            hf = copy.deepcopy(loaded.model)
            hf.set_attn_implementation("sdpa")
            runners[name] = HfGenerate(hf)
        elif args.llama_python:
            runners[name] = LlamaCpp(args.llama_python, loaded.gguf_path, threads)
        else:
            logging.warning("llama.cpp left out: no --llama-python (make bench-cpu LLAMA_CPP=1)")
    for fn in runners.values():
        fn(random_prompt(16, loaded.config.vocab_size, seed=args.repeats), 4)    # warm-up
    runs = {name: [] for name in runners}
    tokens = {}
    for repeat in range(args.repeats):
        # a new prompt each run: with the same one, our prefix cache would serve its full blocks
        prompt = random_prompt(args.prompt_len, loaded.config.vocab_size, seed=repeat)
        for name, fn in runners.items():
            prefill_s, decode_s, tokens[name] = fn(prompt, args.new_tokens)
            runs[name].append({"prefill_s": prefill_s, "decode_s": decode_s,
                               **rates(prefill_s, decode_s, args.prompt_len, args.new_tokens)})
            if isinstance(fn, LlamaCpp):                                    # its own counters, as llama-bench
                prefill_s, decode_s = fn.counters
                runs.setdefault(LLAMA_COUNTERS, []).append(
                    {"prefill_s": prefill_s, "decode_s": decode_s,
                     **rates(prefill_s, decode_s, args.prompt_len, args.new_tokens)})
    for fn in runners.values():
        if isinstance(fn, Worker):
            fn.close()
    summary = {name: rates(statistics.median(r["prefill_s"] for r in rs), statistics.median(r["decode_s"] for r in rs),
                           args.prompt_len, args.new_tokens) for name, rs in runs.items()}
    if args.llama_bench:
        summary.update(llama_bench(args.llama_bench, loaded.gguf_path, threads, args.prompt_len, args.new_tokens,
                                   args.repeats))
    baseline = next((name for name in (LLAMA_COUNTERS, "llama_cpp") if name in summary), None)
    same = {name: common_prefix(tokens[name], tokens.get("ours_quantized", [])) for name in tokens}
    result = {"model": str(loaded.gguf_path.name), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "batch": 1, "threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "workers_omp_wait_policy": "PASSIVE (ours_quantized_passive), OpenMP's default (llama_cpp, llama-bench)",
              "repeats": args.repeats, "torch": torch.__version__,
              "llama_cpp": next((fn.version for fn in runners.values() if isinstance(fn, LlamaCpp)), None),
              "cpu": _cpu_name(), "summary": summary, "runs": runs,
              "greedy_prefix_same_as_ours_quantized": same}
    table = markdown(summary, baseline)
    print(table)
    print(json.dumps({"greedy_prefix_same_as_ours_quantized": same}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        args.out.with_suffix(".md").write_text(table + "\n")


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
