"""Structured output's cost in the engine: decode throughput with and without grammars, and the
time to first token of a request whose JSON schema was never compiled.

    python -m load_tests.structured_bench --device cuda --model random:smollm2-135m --batch 1 64 \
        --prompt-len 128 --new-tokens 256 --repeats 3 --out results/structured.json

Per batch size B, in rounds that take turns (``--repeats``): B unconstrained streams; B streams
each under a JSON schema of its own (compiled in a warm-up, so the round measures decoding); and
for B > 1 one stream with a schema beside B-1 without. Every schema is an array with more items
required than the tokens generated, so no stream can end before its length: every case decodes
B x new-tokens tokens. Tokens/s: generated tokens over the wall time of the batch, prefill
included. Time to first token: arrival in the engine to the first token of one request on an
idle engine, for a schema never seen (compile included), the same schema again (cached), and
no schema, each the median of ``--ttft-samples``.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from models import load_model
from server.engine import EngineConfig, EngineCore, FinishEvent, SamplingParams
from server.engine.grammar import TokenMasks
from server.engine.params import GrammarSpec

from .engine_bench import random_prompts


def stream_schema(stream: int, items: int, nonce: str = "") -> GrammarSpec:
    """A schema of its own per stream (distinct text, so compiled apart) that cannot be complete
    before ``items`` array items."""
    item = {"type": "object", "properties": {f"k{stream}{nonce}": {"type": "integer", "minimum": 0, "maximum": 9999},
                                             "tag": {"enum": [f"a{stream}", "b", "c"]}, "ok": {"type": "boolean"}},
            "required": [f"k{stream}{nonce}", "tag", "ok"]}
    return GrammarSpec("json_schema", json.dumps({"type": "array", "items": item, "minItems": items}))


def serve(core: EngineCore, prompts, specs, new_tokens: int) -> tuple[float, list[FinishEvent]]:
    """All requests at once; the wall time and their finish events, in order."""
    finished = {}
    started = time.perf_counter()
    for i, (prompt, spec) in enumerate(zip(prompts, specs)):
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=spec is None, grammar=spec)
        core.add(f"r{i}", prompt, params, seed=i)
    while core.busy():
        for request_id, event in core.step():
            if isinstance(event, FinishEvent):
                finished[request_id] = event
    elapsed = time.perf_counter() - started
    events = [finished[f"r{i}"] for i in range(len(prompts))]
    bad = [e for e in events if e.reason != "length" or e.completion_tokens != new_tokens]
    assert not bad, bad[:3]
    return elapsed, events


def throughput(core, args, vocab: int) -> list[dict]:
    """Per batch size: tokens/s of each case (median of the rounds), ratios to the free case,
    and every round's figure. ``--fill-threads`` adds the own-schema case with token masks filled
    by that many threads."""
    masks = core.runner.token_masks
    fill_threads = {None: masks}
    for threads in args.fill_threads:
        fill_threads[str(threads)] = TokenMasks(core.runner.max_batch, masks.vocab_size, masks.device, threads)
    rows = []
    for batch in args.batch:
        items = args.new_tokens
        cases = {"free": [None] * batch, "schemas": [stream_schema(i, items) for i in range(batch)]}
        if batch > 1:
            cases["one_schema"] = [stream_schema(0, items)] + [None] * (batch - 1)
        for threads in args.fill_threads:
            cases[f"schemas_{threads}_threads"] = cases["schemas"]
        serve(core, random_prompts(batch, args.prompt_len, vocab, 0), cases["schemas"], 8)      # compiles, warms
        samples = {name: [] for name in cases}
        for r in range(args.repeats):
            for c, (name, specs) in enumerate(cases.items()):      # prompts of their own: no prefix-cache hits
                prompts = random_prompts(batch, args.prompt_len, vocab, 1 + 10 * r + c)
                threads = name.split("_")[1] if name.endswith("_threads") else None
                core.runner.token_masks = fill_threads[threads]
                elapsed, _ = serve(core, prompts, specs, args.new_tokens)
                samples[name].append(batch * args.new_tokens / elapsed)
        best = {name: statistics.median(v) for name, v in samples.items()}
        row = {"batch": batch, **{f"{k}_tok_s": round(v, 1) for k, v in best.items()},
               "schemas_ratio": round(best["schemas"] / best["free"], 3)}
        if "one_schema" in best:
            row["one_schema_ratio"] = round(best["one_schema"] / best["free"], 3)
        for threads in args.fill_threads:
            row[f"schemas_{threads}_threads_ratio"] = round(best[f"schemas_{threads}_threads"] / best["free"], 3)
        row["spread"] = {k: [round(x, 1) for x in v] for k, v in samples.items()}
        rows.append(row)
    return rows


def first_token_ms(core, args, vocab: int) -> dict:
    samples = {"new_schema": [], "cached_schema": [], "free": []}
    for s in range(args.ttft_samples):
        prompt = random_prompts(1, args.prompt_len, vocab, 100 + s)
        fresh = stream_schema(s, 4, nonce=f"_{time.monotonic_ns()}")
        for name, spec in (("new_schema", fresh), ("cached_schema", fresh), ("free", None)):
            _, (event,) = serve(core, prompt, [spec], 2)
            samples[name].append(1e3 * event.timings["ttft"])
    return {k: round(statistics.median(v), 2) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-samples", type=int, default=5)
    parser.add_argument("--fill-threads", type=int, nargs="*", default=[],
                        help="also the own-schema case with masks filled by this many threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    loaded = load_model(args.model, dtype=dtype, device=args.device)
    config = EngineConfig(max_batch=max(args.batch), max_model_len=args.prompt_len + args.new_tokens + 16)
    core = EngineCore(loaded, config, publish=lambda pairs, stats: None)
    vocab = loaded.model.get_input_embeddings().num_embeddings
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"model": args.model, "device": device, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "throughput": throughput(core, args, vocab), "ttft_ms": first_token_ms(core, args, vocab)}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    print(f"structured output, {args.model} on {device}, prompt {args.prompt_len}, {args.new_tokens} new tokens")
    print("| B | free tok/s | own schema each tok/s | ratio | 1 schema + B-1 free tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    for row in result["throughput"]:
        print(f"| {row['batch']} | {row['free_tok_s']} | {row['schemas_tok_s']} | {row['schemas_ratio']} | "
              f"{row.get('one_schema_tok_s', '-')} | {row.get('one_schema_ratio', '-')} |")
    for row in result["throughput"]:
        spread = ", ".join(f"{name} {min(v):.0f}-{max(v):.0f}" for name, v in row["spread"].items())
        print(f"B={row['batch']}: every round's tok/s: {spread}")
        for threads in args.fill_threads:
            print(f"B={row['batch']}: own schema each, masks filled by {threads} threads: "
                  f"{row[f'schemas_{threads}_threads_tok_s']} tok/s, {row[f'schemas_{threads}_threads_ratio']}")
    t = result["ttft_ms"]
    print(f"time to first token (ms, median): new schema {t['new_schema']}, same schema again "
          f"{t['cached_schema']}, no schema {t['free']}")


if __name__ == "__main__":
    main()
