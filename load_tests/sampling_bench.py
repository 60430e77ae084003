"""What log-probabilities, n and the logit adjustments cost the engine, offline.

One engine core serves, taking turns over ``--repeats`` rounds (median reported), each round on
fresh random prompts:

- ``plain``: ``--streams`` greedy streams asking for none of these (the baseline);
- ``top_logprobs``: the same streams, each asking for the sampled token's and the 20 likeliest
  tokens' log-probabilities (the target: at least 0.9x plain's tokens/s);
- ``penalties``: the same streams with presence and frequency penalties and a logit bias;
- ``n1`` / ``n8``: one request of ``--n-prompt-len`` tokens with n = 1, and with n = 8 (its
  choices added as the HTTP layer adds them, sharing the prompt's blocks): time to the first
  token of any choice and of the last choice, and output tokens/s (targets: TTFT within 1.2x of
  n = 1, at least 4x the output tokens/s of one stream).

    python -m load_tests.sampling_bench --device cuda --model random:smollm2-135m --out results/sampling.json
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from models import load_model
from server.engine import EngineConfig, EngineCore, FinishEvent, SamplingParams, TokenEvent

from .engine_bench import random_prompts, sync


def serve(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams, str | None]]) -> dict:
    """Adds every request at once (``follows``: the id of an earlier choice of the same prompt)
    and steps until all finish; wall time, tokens, and each request's time to its first token."""
    first: dict[str, float] = {}
    tokens = [0]

    def publish(pairs, stats):
        now = time.perf_counter()
        for request_id, event in pairs:
            if type(event) is TokenEvent:
                tokens[0] += 1
                first.setdefault(request_id, now)
            elif isinstance(event, FinishEvent) and event.reason not in ("length", "eos", "stop"):
                raise RuntimeError(f"{request_id} ended with {event.reason}: {event.error}")

    core.publish = publish
    started = time.perf_counter()
    for i, (request_id, prompt, params, follows) in enumerate(requests):
        core.add(request_id, prompt, params, seed=i, follows=follows)
    core.run_until_idle()
    sync(core.runner.device)
    elapsed = time.perf_counter() - started
    ttfts = sorted(first[r[0]] - started for r in requests)
    return {"seconds": elapsed, "tokens": tokens[0], "tok_s": tokens[0] / elapsed,
            "ttft_first_s": ttfts[0], "ttft_last_s": ttfts[-1]}


def scenarios(args, vocab: int) -> dict:
    new = args.new_tokens
    plain = SamplingParams(max_new_tokens=new, ignore_eos=True)
    logprobs = SamplingParams(max_new_tokens=new, ignore_eos=True, logprobs=True, top_logprobs=20)
    penalties = SamplingParams(max_new_tokens=new, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3,
                               logit_bias=((11, 2.0), (42, -5.0)))

    def streams(params):
        def build(round_):
            prompts = random_prompts(args.streams, args.prompt_len, vocab, seed=1000 * round_ + 1)
            return [(f"r{round_}-{i}", p, params, None) for i, p in enumerate(prompts)]
        return build

    def choices(n):
        def build(round_):
            prompt = random_prompts(1, args.n_prompt_len, vocab, seed=1000 * round_ + 7 + n)[0]
            params = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=1.0)
            return [(f"n{n}-{round_}-{i}", prompt, params, None if i == 0 else f"n{n}-{round_}-0")
                    for i in range(n)]
        return build

    return {"plain": streams(plain), "top_logprobs": streams(logprobs), "penalties": streams(penalties),
            "n1": choices(1), "n8": choices(8)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--n-prompt-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    core = EngineCore(loaded, EngineConfig(max_batch=args.max_batch), publish=lambda pairs, stats: None)
    vocab = core.info.vocab_size
    runs = scenarios(args, vocab)
    results: dict[str, list[dict]] = {name: [] for name in runs}
    serve(core, runs["plain"](99))                                # warm-up of every path
    serve(core, runs["top_logprobs"](98))
    serve(core, runs["n8"](97))
    for round_ in range(args.repeats):
        for name, build in runs.items():
            results[name].append(serve(core, build(round_)))

    def median(name, key):
        return statistics.median(r[key] for r in results[name])

    summary = {name: {key: median(name, key) for key in ("tok_s", "ttft_first_s", "ttft_last_s")} for name in runs}
    one_stream_tok_s = summary["n1"]["tok_s"]
    checks = {
        "top_logprobs_vs_plain_tok_s": summary["top_logprobs"]["tok_s"] / summary["plain"]["tok_s"],
        "penalties_vs_plain_tok_s": summary["penalties"]["tok_s"] / summary["plain"]["tok_s"],
        "n8_vs_n1_ttft_first": summary["n8"]["ttft_first_s"] / summary["n1"]["ttft_first_s"],
        "n8_vs_n1_ttft_last": summary["n8"]["ttft_last_s"] / summary["n1"]["ttft_first_s"],
        "n8_vs_one_stream_tok_s": summary["n8"]["tok_s"] / one_stream_tok_s,
    }
    device = torch.cuda.get_device_name() if loaded.device.type == "cuda" else "cpu"
    report = {"device": device, "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
              "checks": checks, "runs": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(f"{device}; {args.model}; {args.streams} streams x prompt {args.prompt_len}, {args.new_tokens} new; "
          f"n on a {args.n_prompt_len}-token prompt; median of {args.repeats}")
    print("| run | tok/s | TTFT first ms | TTFT last ms |\n|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['tok_s']:.0f} | {1e3 * s['ttft_first_s']:.1f} | {1e3 * s['ttft_last_s']:.1f} |")
    targets = {"top_logprobs_vs_plain_tok_s": ">= 0.9", "n8_vs_n1_ttft_first": "<= 1.2",
               "n8_vs_one_stream_tok_s": ">= 4"}
    print("| ratio | value | target |\n|---|---|---|")
    for name, value in checks.items():
        print(f"| {name} | {value:.2f} | {targets.get(name, '')} |")


if __name__ == "__main__":
    main()
