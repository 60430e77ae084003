"""Where one engine step's time goes: wall time of prefills and decodes, kernels per step, and
the top host and device operations (torch.profiler), with a Chrome trace per step kind.

    python -m load_tests.profile_steps --model random:smollm2-135m --out results/profile
    python -m load_tests.profile_steps --batch 1 --shared-prefix 2048 --prefix-batch 1 16   # prefills after a cached prefix
    python -m load_tests.profile_steps --batch 1 64 --schema   # decode steps under a JSON schema per request
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from models import load_model
from server.engine import EngineConfig, EngineCore, SamplingParams

from .structured_bench import stream_schema


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def host_profile(fn, sort_by: str, lines: int) -> str:
    """cProfile's table of one call of ``fn``, its ``lines`` top functions by ``sort_by``."""
    host = cProfile.Profile()
    host.enable()
    fn()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats(sort_by).print_stats(lines)
    return text.getvalue()


def steady_decode(core, batch: int, prompt, counter, schema: bool = False) -> list[str]:
    """Adds ``batch`` long requests (with ``schema``, each under a JSON schema of its own) and steps
    until every one is decoding; returns their ids."""
    ids = [f"d{next(counter)}" for _ in range(batch)]
    for i, request_id in enumerate(ids):
        grammar = stream_schema(i, 100_000) if schema else None
        core.add(request_id, prompt, SamplingParams(max_new_tokens=100_000, ignore_eos=True, grammar=grammar), seed=0)
    while core.scheduler.waiting or core.compiling:
        core.step()
    for _ in range(3):
        core.step()
    return ids


def prefix_rows(core, args, counter, report: list[str]) -> list[tuple[str, float]]:
    """Prefill steps of prompts that share a cached ``--shared-prefix``, each with its own
    ``--prompt-len`` tokens after it, ``--prefix-batch`` prompts a step: wall time, and the
    device time of the largest by kernel."""
    prefix = [2000 + i % 20000 for i in range(args.shared_prefix)]
    own = iter(range(30000, 10**9))

    def add_after_prefix(n: int):
        for _ in range(n):
            core.add(f"p{next(counter)}", prefix + [next(own) % 40000 + 5 for _ in range(args.prompt_len)],
                     SamplingParams(max_new_tokens=1, ignore_eos=True), seed=0)

    def prefill_after_prefix(n: int):
        add_after_prefix(n)
        core.run_until_idle()

    prefill_after_prefix(1)                            # caches the prefix
    rows = []
    for n in args.prefix_batch:
        prefill_after_prefix(n)                        # warm
        rows.append((f"prefill, {n} x {args.prompt_len} tokens after a cached {args.shared_prefix}-token prefix",
                     timed(lambda: prefill_after_prefix(n), 5)))
    n = max(args.prefix_batch)
    add_after_prefix(n)
    report.append(f"## host profile of {n} prefills after a cached {args.shared_prefix}-token prefix (one step; "
                  f"the requests added before)\n\n```\n{host_profile(core.run_until_idle, 'tottime', 30)}\n```")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_after_prefix(n)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(args.out / "prefill_after_prefix.json"))
    report.append(f"## prefill of {n} x {args.prompt_len} tokens after a cached {args.shared_prefix}-token prefix\n\n"
                  f"{prof.key_averages().table(sort_by='self_cuda_time_total', row_limit=15)}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="KV cache block size")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="also time prefills of prompts that start with this many cached tokens")
    ap.add_argument("--prefix-batch", type=int, nargs="+", default=[1, 16],
                    help="prompts per prefill step after the cached prefix")
    ap.add_argument("--schema", action="store_true",
                    help="decode steps with each request under a JSON schema of its own (structured output)")
    ap.add_argument("--out", type=Path, default=Path("results/profile"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model, device="cuda")
    max_batch = max(args.batch + (args.prefix_batch if args.shared_prefix else []))
    core = EngineCore(loaded, EngineConfig(max_batch=max_batch, num_blocks=(1 << 18) // args.block_size,
                                           max_model_len=4096, block_size=args.block_size),
                      publish=lambda pairs, stats: None)
    prompt = list(range(1000, 1000 + args.prompt_len))
    counter = iter(range(10**9))

    def prefill_one():
        core.add(f"p{next(counter)}", prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), seed=0)
        core.run_until_idle()

    def prefill_many(n: int):
        for _ in range(n):
            core.add(f"p{next(counter)}", prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), seed=0)
        core.run_until_idle()

    lengths = iter(range(args.prompt_len - 40, 10**9))

    def prefill_new_length():
        core.add(f"p{next(counter)}", list(range(1000, 1000 + next(lengths))),
                 SamplingParams(max_new_tokens=1, ignore_eos=True), seed=0)
        core.run_until_idle()

    prefill_one()
    rows = [("prefill, 1 prompt of a length not seen before (~%d tokens)" % args.prompt_len,
             timed(prefill_new_length, 10)),
            ("prefill, 1 x %d tokens" % args.prompt_len, timed(prefill_one, 10)),
            ("prefill, 8 x %d tokens" % args.prompt_len, timed(lambda: prefill_many(8), 5))]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_one()
    prof.export_chrome_trace(str(args.out / "prefill.json"))
    report = [f"## prefill\n\n{prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=20)}"]
    if args.shared_prefix:
        rows += prefix_rows(core, args, counter, report)
    for batch in args.batch:
        started = steady_decode(core, batch, prompt, counter, args.schema)
        elapsed = timed(lambda: [core.step() for _ in range(40)], 1) / 40
        rows.append((f"decode step, B={batch} (all running, no prefill{', a JSON schema each' if args.schema else ''})",
                     elapsed))
        bucket = core.runner.bucket_for(batch)
        if bucket is not None:
            # each replay feeds its own greedy ids to the next: the tokens of these requests no
            # longer match the host's, which is why they are aborted below
            graph = core.runner.graphs[bucket][0]
            rows.append((f"  its graph replayed alone (device time), B={batch}",
                         timed(lambda: [graph.replay() for _ in range(50)], 3) / 50))
        steps = host_profile(lambda: [core.step() for _ in range(20)], "cumulative", 25)
        report.append(f"## host profile of 20 decode steps, B={batch}\n\n```\n{steps}\n```")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                core.step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(args.out / f"decode_b{batch}.json"))
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        rows.append((f"  device operations per decode step, B={batch}", kernels / 5))
        report.append(f"## decode B={batch}\n\n{prof.key_averages().table(sort_by='self_cuda_time_total', row_limit=15)}")
        for request_id in started:
            core.abort(request_id)
        core.run_until_idle()
    (args.out / "profile.md").write_text("\n\n".join(report))
    print("\n".join([r for r in report if r.startswith(("## prefill of", "## host profile of"))] + report[-2:]))
    print("\n| what | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value * 1e3:.2f} ms |" if value < 10 else f"| {name} | {value:.0f} |")


if __name__ == "__main__":
    main()
