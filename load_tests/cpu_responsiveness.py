"""The CPU engine on a shared host: decode gaps while other processes spin, and a long prompt
arriving during a stream.

The engine runs in its own process (``ProcessEngine``, as the server runs it) on the embedded
model's quantised weights, prefix caching off. Phases, in order:

1. idle: one stream; the gaps between its tokens (the idle step time);
2. busy: the same beside ``--busy`` processes spinning on the CPU;
3. long prompt alone: its time to first token;
4. long prompt during a stream: the stream's gaps while the prompt is prefilled, and the
   prompt's time to first token.

    python -m load_tests.cpu_responsiveness --busy 2 --prompt-tokens 4000 --out results/cpu_responsiveness.json
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from server.engine import EngineConfig, FinishEvent, ProcessEngine, SamplingParams

PROSE = Path(__file__).resolve().parent / "accuracy_text.md"     # any English prose, repeated to length


@dataclass
class Result:
    idle_gap_p50_s: float
    idle_gap_max_s: float
    busy_gap_p50_s: float
    busy_gap_max_s: float
    long_ttft_alone_s: float
    long_ttft_with_stream_s: float
    stream_gap_max_during_long_s: float
    stream_tokens_during_long: int
    engine_log_hint: str = "the engine's start-up log states the CPU prefill budget"

    def table(self) -> str:
        rows = [("decode gap p50 / max, idle", f"{self.idle_gap_p50_s * 1e3:.0f} / {self.idle_gap_max_s * 1e3:.0f} ms"),
                ("decode gap p50 / max, busy host", f"{self.busy_gap_p50_s * 1e3:.0f} / {self.busy_gap_max_s * 1e3:.0f} ms"),
                ("busy max / idle p50", f"{self.busy_gap_max_s / self.idle_gap_p50_s:.1f}x"),
                ("long prompt TTFT alone", f"{self.long_ttft_alone_s:.2f} s"),
                ("long prompt TTFT beside a stream", f"{self.long_ttft_with_stream_s:.2f} s "
                                                     f"({self.long_ttft_with_stream_s / self.long_ttft_alone_s:.2f}x)"),
                ("stream's worst gap during it", f"{self.stream_gap_max_during_long_s:.2f} s "
                                                 f"({self.stream_tokens_during_long} tokens meanwhile)")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def long_prompt(tokenizer, tokens: int) -> list[int]:
    ids = tokenizer(PROSE.read_text())["input_ids"]
    while len(ids) < tokens:
        ids = ids + ids
    return list(ids[:tokens])


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


async def arrivals(engine, prompt: list[int], new_tokens: int, started: asyncio.Event | None = None,
                   stop: asyncio.Event | None = None) -> list[float]:
    """The arrival times of a request's tokens; ``started`` is set at the fifth, and the request
    is aborted once ``stop`` is set."""
    stream = engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    times = []
    async for event in stream:
        if isinstance(event, FinishEvent):
            assert event.reason in ("length", "abort"), event
            return times
        times.append(time.monotonic())
        if started is not None and len(times) == 5:
            started.set()
        if stop is not None and stop.is_set():
            stream.abort()
    return times


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


async def run(engine, busy: int, prompt_tokens: int, stream_tokens: int) -> Result:
    short = [1, 2, 3, 4, 5, 6, 7, 8]
    long = long_prompt(engine.tokenizer, prompt_tokens)
    await arrivals(engine, short, 16)                                    # warm
    idle = gaps(await arrivals(engine, short, stream_tokens))[2:]
    spinning = busy_processes(busy)
    try:
        busy_gaps = gaps(await arrivals(engine, short, stream_tokens))[2:]
    finally:
        for p in spinning:
            p.kill()
            p.wait()
    sent = time.monotonic()
    (first, *_) = await arrivals(engine, long, 1)
    alone = first - sent
    started, stop = asyncio.Event(), asyncio.Event()
    stream = asyncio.create_task(arrivals(engine, short, engine.max_model_len - len(short), started, stop))
    await started.wait()
    sent = time.monotonic()
    (first, *_) = await arrivals(engine, long, 1)
    with_stream = first - sent
    await asyncio.sleep(1.0)
    stop.set()
    times = await stream
    during = [t for t in times if sent <= t <= first + 0.5]
    window = [t for t in times if t >= sent][:len(during) + 1]
    before = max(t for t in times if t < sent)
    return Result(statistics.median(idle), max(idle), statistics.median(busy_gaps), max(busy_gaps), alone,
                  with_stream, max(gaps([before] + window)), len(during))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busy", type=int, default=2, help="spinning processes beside the engine in phase 2")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--stream-tokens", type=int, default=100)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    engine = ProcessEngine("default", device="cpu", config=EngineConfig(cpu_weights="quantized", prefix_caching=False))
    engine.start()
    try:
        result = asyncio.run(run(engine, args.busy, args.prompt_tokens, args.stream_tokens))
    finally:
        engine.shutdown()
    if args.out:
        args.out.write_text(json.dumps(asdict(result), indent=2) + "\n")
    print(result.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
