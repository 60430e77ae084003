"""Offline decode throughput: our engine and transformers' ``generate`` side by side.

Both run in this one process on the same model weights, dtype and random prompts, with
generation forced to the full length. Tokens/s counts generated tokens over the wall time of
the whole batch (prefill included), as vLLM's offline throughput benchmark does.

    python -m load_tests.engine_bench --device cpu --model default --batch 1 --prompt-len 128 --new-tokens 64
    python -m load_tests.engine_bench --device cuda --model random:smollm2-135m --batch 1 16 64 256 \
        --long-batch 1 8 --hf default static --out results/engine.json
    python -m load_tests.engine_bench --device cuda --model random:smollm2-135m --batch 1 256 --hf \
        --block-size 128 32 --repeats 6      # two engines, one per block size, taking turns
    python -m load_tests.engine_bench --device cuda --model random:smollm2-135m --batch 16 64 --hf \
        --shared-prefix 2048 --prefix-caching on off      # one engine with prefix caching, one without
    python -m load_tests.engine_bench --device cuda --model random:smollm2-135m --hf \
        --kv-cache-dtype auto int8 --decode-step 8:32768 256:4096 1:128   # the decode step alone

``--closed-loop K`` keeps ``--batch`` streams busy, each sending K requests in turn, the next as
soon as its last one finishes (a server's load without the HTTP in front), and adds each engine's
median time to first token (arrival in the engine to the first token):

    python -m load_tests.engine_bench --device cuda --model random:smollm2-135m --batch 16 64 --closed-loop 8 \
        --shared-prefix 2048 --prefix-caching on off --fill-pool

``--kv-cache-dtype auto int8`` runs one engine per KV cache type, interleaved (ours_int8 columns).
``--decode-step B:CTX ...`` times only the decode step instead (no prefill, no sampling): the
batch's CUDA graph replayed over B sequences of CTX cached tokens each, median GPU time per
replay, per engine, with each engine's ratio to the first's (the cache contents do not change
the step's time, so none are prefilled).

Every run draws new prompts (the same for every engine and transformers in that round), so a
prefix cache never serves one run from an earlier one; with ``--shared-prefix N`` every prompt
starts with the same N tokens, then its own ``--prompt-len``.
"""

import argparse
import copy
import gc
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from benchmarks.kernel_bench import replay_us
from models import load_model
from server.engine import EngineConfig, EngineCore, FinishEvent, SamplingParams, freeze_startup_heap
from server.engine.block_manager import BlockManager
from server.engine.config import KV_CACHE_DTYPES
from server.engine.output import OutputProcessor
from server.engine.sequence import Sequence


def random_prompts(batch: int, length: int, vocab: int, seed: int, prefix: list[int] = ()) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + row for row in torch.randint(10, vocab - 10, (batch, length), generator=g).tolist()]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _serve(core: EngineCore, prompts, new_tokens: int, streams: int) -> tuple[float, list]:
    """Drives the engine core directly, as an offline job: no event loop in the way, the tokens
    made into text in the same thread, as the in-process server does. ``prompts`` are served
    ``streams`` at a time, the next one admitted as soon as one finishes; returns the wall time
    and the finish events."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    finished = []
    output = OutputProcessor(core.tokenizer)
    queue = iter(enumerate(prompts))

    def start_next():
        i, prompt = next(queue, (None, None))
        if prompt is not None:
            output.add(f"bench-{i}", prompt, params)
            core.add(f"bench-{i}", prompt, params, seed=i)

    def publish(pairs, stats):
        for _, event in output.process(pairs)[0]:
            if isinstance(event, FinishEvent):
                finished.append(event)
                start_next()

    core.publish = publish
    started = time.perf_counter()
    for _ in range(streams):
        start_next()
    core.run_until_idle()
    elapsed = time.perf_counter() - started
    assert len(finished) == len(prompts) and all(e.completion_tokens == new_tokens for e in finished), finished[:3]
    return elapsed, finished


def run_ours(core: EngineCore, prompts, new_tokens: int) -> float:
    """Every prompt submitted at once, as a batch job; the wall time."""
    return _serve(core, prompts, new_tokens, len(prompts))[0]


def run_closed_loop(core: EngineCore, prompts, new_tokens: int, streams: int) -> tuple[float, list[float]]:
    """``prompts`` served ``streams`` at a time, a new one starting as soon as one finishes (as a
    server under ``streams`` clients that each send their next request when the last one ends).
    Returns the wall time and every request's time to first token (arrival in the engine to its
    first token), in seconds."""
    elapsed, finished = _serve(core, prompts, new_tokens, streams)
    return elapsed, [e.timings["ttft"] for e in finished]


def fill_pool(core: EngineCore, vocab: int, seed: int) -> None:
    """Prefills as many random tokens as the pool holds, one new token each, so that an engine
    with prefix caching has every block cached (as a server's after a while) and each allocation
    from then on evicts the least recently used block."""
    bs = core.runner.block_size
    length = bs * max(1, min(16, (core.max_model_len - 1) // bs))      # whole blocks, each cached when it ends
    prompts = random_prompts(-(-core.runner.kv_tokens // length), length, vocab, seed)
    for start in range(0, len(prompts), 64):
        run_ours(core, prompts[start:start + 64], 1)


def run_hf(model, prompts, new_tokens: int, mode: str) -> float:
    ids = torch.tensor(prompts, device=model.device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    if mode == "static":
        kwargs["cache_implementation"] = "static"
    sync(model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    sync(model.device)
    assert out.shape[1] - ids.shape[1] == new_tokens
    return time.perf_counter() - started


def decode_step_us(core: EngineCore, batch: int, context: int, replays: int = 50) -> float:
    """Median GPU time of one replay of the decode graph serving ``batch`` sequences of ``context``
    cached tokens each (their blocks taken from a manager of its own; the cache is not filled)."""
    runner = core.runner
    bucket = runner.bucket_for(batch)
    if bucket is None:
        raise ValueError(f"no decode graph serves batch {batch} (buckets {sorted(runner.graphs)})")
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seqs = []
    for i in range(batch):
        seq = Sequence(f"step-{i}", [100 + (i * 31 + j) % 20000 for j in range(context - 1)], SamplingParams(), 0)
        seq.num_cached = seq.length
        seq.append(7)
        blocks.grow(seq.block_table, seq.length)
        seqs.append(seq)
    with torch.inference_mode():
        runner.decode(seqs)                         # loads the step's inputs into the graph's buffers
    graph = runner.graphs[bucket][0]
    for _ in range(5):
        graph.replay()
    return replay_us(graph, replays)


def decode_step_table(loaded, args) -> dict:
    cases = [tuple(int(x) for x in c.split(":")) for c in args.decode_step]
    longest = max(ctx for _, ctx in cases) + 16
    bs = args.block_size[0]
    num_blocks = max(b * (-(-(ctx + 16) // bs) + 1) for b, ctx in cases)      # the largest case's
    engines = {}
    for kv in args.kv_cache_dtype:
        config = EngineConfig(max_batch=max(b for b, _ in cases), max_model_len=longest, num_blocks=num_blocks,
                              block_size=bs, graph_buckets=tuple(sorted({b for b, _ in cases})),
                              prefill_graph_buckets=(), kv_cache_dtype=kv)
        name = "ours" + ("" if kv == args.kv_cache_dtype[0] else f"_{kv}")
        engines[name] = EngineCore(loaded, config, publish=lambda pairs, stats: None)
    rows = []
    for batch, context in cases:
        samples = {name: [] for name in engines}
        for _ in range(args.repeats):               # engines take turns
            for name, core in engines.items():
                samples[name].append(decode_step_us(core, batch, context))
        row = {"batch": batch, "context": context}
        for name, v in samples.items():
            row[f"{name}_us"] = statistics.median(v)
            row[f"{name}_speedup"] = row["ours_us"] / row[f"{name}_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    names = list(engines)
    lines = ["| B | context | " + " | ".join(f"{n} us" for n in names) + " | " +
             " | ".join(f"{n} speedup" for n in names[1:]) + " |", "|" + "---|" * (2 + 2 * len(names) - 1)]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | " + " | ".join(f"{r[f'{n}_us']:.1f}" for n in names) + " | "
                     + " | ".join(f"{r[f'{n}_speedup']:.2f}x" for n in names[1:]) + " |")
    print("decode step alone (CUDA graph replay, median GPU time):")
    print("\n".join(lines))
    return {"model": args.model, "gpu": torch.cuda.get_device_name(loaded.device),
            "block_size": bs, "kv_cache_dtypes": args.kv_cache_dtype,
            "kv_pool_tokens": {n: c.runner.kv_tokens for n, c in engines.items()}, "decode_step": rows}


def interleaved(runners: dict, repeats: int) -> dict:
    """Seconds of each run of each runner, taking turns so drifting machine load hits all alike;
    ``fn(round)`` gets the round's number. Each run starts from a collected, frozen heap, so the
    objects an earlier run left behind do not slow its garbage collections; the heap is unfrozen
    after it."""
    samples = {name: [] for name in runners}
    for round_ in range(repeats):
        for name, fn in runners.items():
            freeze_startup_heap()
            try:
                samples[name].append(fn(round_))
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
            finally:
                gc.unfreeze()
    return {name: v for name, v in samples.items() if v}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--long-batch", type=int, nargs="*", default=[], help="batches for the long-context rows")
    ap.add_argument("--long-prompt-len", type=int, default=32768)
    ap.add_argument("--long-new-tokens", type=int, default=128)
    ap.add_argument("--hf", nargs="*", default=["default"], choices=["default", "static"],
                    help="transformers generate settings to run beside ours")
    ap.add_argument("--hf-long", nargs="*", default=None, choices=["default", "static"],
                    help="transformers settings for the long-context rows (default: as --hf)")
    ap.add_argument("--hf-max-batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--block-size", type=int, nargs="+", default=[EngineConfig.block_size],
                    help="KV cache block size; several: one engine each, interleaved in every case (ours_bsN "
                         "columns for all but the first), with pools of equal tokens (--num-blocks counts blocks "
                         "of the first size; without it, room for every case)")
    ap.add_argument("--prefix-caching", nargs="+", choices=["on", "off"], default=["on"],
                    help="prefix caching of the engine; both: one engine each, interleaved (ours_nocache columns)")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="every prompt starts with the same N random tokens, then its own --prompt-len")
    ap.add_argument("--closed-loop", type=int, default=None, metavar="K",
                    help="each of --batch streams sends K requests in turn, the next as soon as its last "
                         "one finishes; adds the median time to first token (transformers is not run)")
    ap.add_argument("--fill-pool", action="store_true",
                    help="before timing, prefill as many tokens as each engine's pool holds, so that a "
                         "caching engine's pool is full of cached blocks and every allocation evicts")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--prefill-graph-buckets", type=int, nargs="*", default=None,
                    help="token buckets of prefill graphs (none given: off; default: the engine's)")
    ap.add_argument("--kv-cache-dtype", nargs="+", choices=KV_CACHE_DTYPES, default=["auto"],
                    help="KV cache element type; several: one engine each, interleaved (ours_int8 columns)")
    ap.add_argument("--decode-step", nargs="*", default=None, metavar="B:CTX",
                    help="time only the decode step at these batches and cached lengths (CUDA only)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if len(set(args.kv_cache_dtype)) != len(args.kv_cache_dtype):
        ap.error("--kv-cache-dtype: each type once")
    if len(set(args.block_size)) != len(args.block_size):
        ap.error("--block-size: each size once")
    if len(set(args.prefix_caching)) != len(args.prefix_caching):
        ap.error("--prefix-caching: each setting once")
    if args.shared_prefix < 0:
        ap.error("--shared-prefix must be >= 0")
    if args.closed_loop is not None and args.closed_loop < 1:
        ap.error("--closed-loop must be >= 1")
    if args.closed_loop:
        args.hf = []
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    device = loaded.device
    if args.decode_step:
        if device.type != "cuda":
            ap.error("--decode-step times CUDA graph replays")
        result = decode_step_table(loaded, args)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
        return
    vocab = loaded.config.vocab_size
    long_modes = args.hf if args.hf_long is None else args.hf_long
    prefix = random_prompts(1, args.shared_prefix, vocab, seed=12345)[0] if args.shared_prefix else []
    # (batch, shared prefix, own prompt tokens, new tokens, transformers settings)
    cases = [(b, args.shared_prefix, args.prompt_len, args.new_tokens, args.hf) for b in args.batch]
    cases += [(b, 0, args.long_prompt_len, args.long_new_tokens, long_modes) for b in args.long_batch]
    longest = max(s + p + n for _, s, p, n, _ in cases)
    max_batch = max(c[0] for c in cases)
    pool_tokens = None
    if args.num_blocks is not None:
        pool_tokens = args.num_blocks * args.block_size[0]
    elif len(args.block_size) > 1:                 # room for every sequence of each case
        pool_tokens = max(b * (s + p + n + max(args.block_size)) for b, s, p, n, _ in cases)
    engines = {}
    for block_size, caching, kv in ((b, c, k) for b in args.block_size for c in args.prefix_caching
                                    for k in args.kv_cache_dtype):
        config = EngineConfig(max_batch=max_batch, max_model_len=max(longest, 1024),
                              max_prefill_tokens=8192,
                              num_blocks=None if pool_tokens is None else -(-pool_tokens // block_size),
                              gpu_memory_fraction=0.45 if args.hf else 0.8,
                              cuda_graphs=not args.no_graphs,
                              prefill_graph_buckets=None if args.prefill_graph_buckets is None
                              else tuple(args.prefill_graph_buckets), block_size=block_size,
                              prefix_caching=caching == "on", kv_cache_dtype=kv)
        name = "ours" + ("" if block_size == args.block_size[0] else f"_bs{block_size}") + \
            ("" if caching == args.prefix_caching[0] else ("_cache" if caching == "on" else "_nocache")) + \
            ("" if kv == args.kv_cache_dtype[0] else f"_{kv}")
        engines[name] = EngineCore(loaded, config, publish=lambda pairs, stats: None)
    engine = engines["ours"]
    if args.fill_pool:
        for core in engines.values():
            fill_pool(core, vocab, seed=777)
    hf_model = None
    if args.hf:
        hf_model = copy.deepcopy(loaded.model)
        hf_model.set_attn_implementation("sdpa")

    rows = []
    for batch, shared, own, new_tokens, modes in cases:
        prompt_len = shared + own

        requests = batch * (args.closed_loop or 1)

        def prompts_of(round_, requests=requests, own=own, shared=prefix[:shared]):
            return random_prompts(requests, own, vocab, seed=(requests * 7 + own) * 1000 + round_ + 1, prefix=shared)

        ttfts = {name: [] for name in engines}          # closed loop: each run's median time to first token

        def closed_loop(round_, name, core, batch=batch):
            elapsed, firsts = run_closed_loop(core, prompts_of(round_), new_tokens, batch)
            ttfts[name].append(statistics.median(firsts))
            return elapsed

        if args.closed_loop:
            runners = {name: lambda r, name=name, core=core: closed_loop(r, name, core) for name, core in engines.items()}
        else:
            runners = {name: lambda r, core=core: run_ours(core, prompts_of(r), new_tokens)
                       for name, core in engines.items()}
        for mode in modes:
            if batch <= args.hf_max_batch:
                runners[f"hf_{mode}"] = lambda r, mode=mode: run_hf(hf_model, prompts_of(r), new_tokens, mode)
        prompts = prompts_of(-1)                                            # the warm-ups'
        for core in engines.values():
            run_ours(core, prompts[:1], 4)                                  # warm-up
        for mode in args.hf:
            if f"hf_{mode}" in runners:
                # warm-up; the static cache is sized by the length, so it warms up (compiles) at full length
                run_hf(hf_model, prompts, new_tokens if mode == "static" else min(new_tokens, 8), mode)
        samples = interleaved(runners, args.repeats)
        times = {name: statistics.median(v) for name, v in samples.items()}
        row = {"batch": batch, "prompt_len": prompt_len, "shared_prefix": shared, "new_tokens": new_tokens,
               "requests": requests, "ours_s": times["ours"], "ours_tok_per_s": requests * new_tokens / times["ours"]}
        row["tok_per_s"] = row["ours_tok_per_s"]
        for name in list(engines)[1:]:
            row[f"{name}_tok_per_s"] = requests * new_tokens / times[name] if name in times else None
        for name, values in ttfts.items():
            if values:
                row[f"{name}_ttft_ms"] = 1e3 * statistics.median(values)
        for mode in args.hf:
            t = times.get(f"hf_{mode}")
            row[f"hf_{mode}_tok_per_s"] = batch * new_tokens / t if t else None
        hf_rates = [row.get(f"hf_{m}_tok_per_s") for m in args.hf]
        best = max((r for r in hf_rates if r), default=None)
        row["ratio_to_best_hf"] = row["ours_tok_per_s"] / best if best else None
        row["runs_s"] = samples
        rows.append(row)
        print(json.dumps(row), flush=True)

    result = {"model": args.model, "device": str(device), "dtype": str(loaded.dtype),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "kv_pool_tokens": engine.runner.kv_tokens, "block_size": engine.runner.block_size,
              "engines": {name: {"block_size": core.runner.block_size, "kv_pool_tokens": core.runner.kv_tokens,
                                 "prefix_caching": core.blocks.prefix_caching,
                                 "prefix_cache_hit_share": core.blocks.hit_tokens / max(core.blocks.query_tokens, 1)}
                          for name, core in engines.items()},
              "graph_buckets": sorted(engine.runner.graphs),
              "capture_s": engine.runner.capture_seconds, "ours": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    print(markdown(rows, args.hf, list(engines)[1:]))


def markdown(rows, modes, others=()) -> str:
    names = ["ours", *others] + [f"hf_{m}" for m in modes]
    timed_first = [n for n in ["ours", *others] if any(f"{n}_ttft_ms" in r for r in rows)]
    head = (["B", "prompt", "new"] + [f"{n} tok/s" for n in names] + [f"{n} TTFT p50 ms" for n in timed_first]
            + ["ours / best HF"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rates = [f"{r.get(f'{n}_tok_per_s') or float('nan'):.1f}" for n in names]
        firsts = [f"{r.get(f'{n}_ttft_ms') or float('nan'):.2f}" for n in timed_first]
        ratio = f"{r['ratio_to_best_hf']:.2f}x" if r["ratio_to_best_hf"] else "-"
        shared = r.get("shared_prefix") or 0
        prompt = f"{shared}+{r['prompt_len'] - shared}" if shared else str(r["prompt_len"])
        lines.append("| " + " | ".join([str(r["batch"]), prompt, str(r["new_tokens"]), *rates, *firsts, ratio]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
