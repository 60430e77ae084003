"""Asynchronous HTTP load generator for streaming LLM servers, measuring as vLLM's serving benchmark.

It drives ``POST /generate_stream`` (TGI style, this project's server), ``POST /v1/completions`` or
``POST /v1/chat/completions`` (OpenAI style, this server or any compatible one) with prompts of a
chosen token length, and reports TTFT, TPOT, ITL and end-to-end latency (mean and percentiles),
request throughput, output tokens/s and goodput under SLOs. Two modes:

- a sweep of fixed concurrencies (closed loop: N clients, each sends its next request when the
  previous one ends): ``--concurrency 1,16,64,256``;
- request rates with Poisson (``--burstiness 1``) or gamma arrivals (burstiness < 1 is burstier,
  > 1 more regular): ``--request-rate 2,8,inf``, optionally capped by ``--max-concurrency``.

Prompts share nothing by default. ``--shared-prefix N`` starts every request with the same N
tokens (a system prompt); ``--multi-turn T`` makes each client hold conversations of T turns, each
turn resending the conversation so far plus a new question. The report gives the share of prompt
tokens the server said it served from its prefix cache (``usage.prompt_tokens_details.cached_tokens``,
TGI ``details.cached_tokens``).

Every request asks for ``--output-len`` tokens unless ``--output-range r`` draws each one's length
in [L(1-r), L(1+r)] (vLLM's ``--random-range-ratio``). With one length for all, a closed loop's
streams that start together are prefilled together, finish together and come back together, so
they fall into waves whose size depends on the run's early history.

Results go to ``--out-dir``: ``results.json``, ``report.md`` (also printed) and PNG plots.
``--engine-json`` puts the offline engine benchmark's tokens/s beside each concurrency (rows
``{"batch", "tok_per_s"}`` under ``"ours"``, as ``load_tests/engine_bench.py --out`` writes them;
rows naming other prompt or output lengths are left out) with the ratio HTTP / engine.

The HTTP-against-engine sweep on a GPU host, the server started and stopped by the tool:

    python -m load_tests.engine_bench --device cuda --model random:smollm2-135m \\
        --batch 1 16 64 256 --prompt-len 128 --new-tokens 256 --out results/engine.json
    python -m load_tests.loadgen --serve "--model random:smollm2-135m --device cuda" \\
        --concurrency 1,16,64,256 --input-len 128 --output-len 256 --workers 4 \\
        --engine-json results/engine.json --out-dir results/h200 --strict

One client process streams some 10-20 thousand tokens/s before its own CPU becomes the limit (the
report's "client CPU" column shows it, and a warning says so): ``--workers N`` spreads each level
over N processes. The client streams through aiohttp (about half httpx's CPU per streamed token)
and parses a request whose text no later turn needs after the level, so parsing neither delays
the next request nor counts in the client CPU column. ``--request-timeout`` bounds a whole
request, the stream included.

Every run is bounded: a fixed number of requests per level, ``--max-duration`` per level and
``--request-timeout`` per request. Targets other than loopback addresses need ``--allow-remote``.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import math
import os
import platform
import queue
import random
import socket
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import httpx

from .backends import BACKENDS, Backend
from .metrics import RequestResult, parse_slos, summarize
from .prompts import PromptSource, lengths_around, load_tokenizer

log = logging.getLogger("loadgen")


# ----------------------------------------------------------------------------- one request

@dataclass
class Unparsed:
    """A streamed request's ``data:`` lines, stamped as they arrived, not yet parsed."""
    result: RequestResult
    events: list[tuple[float, bytes]]
    t0: float
    t_end: float


async def send_request(client: aiohttp.ClientSession, backend: Backend, url: str, prompt: str,
                       prompt_len: int, max_tokens: int, headers: dict, t_level: float,
                       parse: bool = True) -> RequestResult | Unparsed:
    """Send one streaming request; the loop only stamps and stores ``data:`` lines. Parsed at once
    (``parse``), or returned unparsed (``parse_result`` later) when the text is not needed yet:
    a closed loop's client then sends its next request without first parsing hundreds of events,
    which would otherwise delay it and the other streams of its process."""
    result = RequestResult(prompt_len=prompt_len, max_tokens=max_tokens)
    events: list[tuple[float, bytes]] = []
    body = backend.body(prompt, max_tokens)
    t0 = time.perf_counter()
    result.start = t0 - t_level
    try:
        sent = {**headers, "X-Request-Start": f"t={time.time():.6f}"}    # the server logs the way in
        async with client.post(url, json=body, headers=sent, allow_redirects=False) as resp:
            result.status = resp.status
            if resp.status != 200:
                detail = (await resp.read()).decode("utf-8", "replace").strip()
                result.error = f"HTTP {resp.status}: {detail[:300]}"
                result.latency = time.perf_counter() - t0
                return result
            pending = b""
            async for chunk in resp.content.iter_any():
                t = time.perf_counter()
                pending += chunk
                if b"\n" not in chunk:
                    continue
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.startswith(b"data:"):
                        data = line[5:].strip()
                        if data and data != b"[DONE]":
                            events.append((t, data))
            if pending.startswith(b"data:") and pending[5:].strip() not in (b"", b"[DONE]"):
                events.append((time.perf_counter(), pending[5:].strip()))
        t_end = time.perf_counter()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        result.latency = time.perf_counter() - t0
        return result

    unparsed = Unparsed(result, events, t0, t_end)
    return parse_result(unparsed, backend) if parse else unparsed


def parse_result(unparsed: Unparsed, backend: Backend) -> RequestResult:
    """The request's result completed from its stored events."""
    result, t0, t_end = unparsed.result, unparsed.t0, unparsed.t_end
    parsed = backend.parse(unparsed.events)
    result.latency = t_end - t0
    result.tokens_counted = parsed.tokens
    result.chunks = len(parsed.token_times)
    result.tokens_reported = parsed.completion_tokens
    result.prompt_tokens_reported = parsed.prompt_tokens
    result.cached_tokens_reported = parsed.cached_tokens
    result.text = parsed.text
    result.finish_reason = parsed.finish_reason
    result.text_chars = len(parsed.text)
    if parsed.token_times:
        result.ttft = parsed.token_times[0] - t0
        result.itl = [b - a for a, b in zip(parsed.token_times, parsed.token_times[1:])]
    if parsed.error:
        result.error = parsed.error
    elif not parsed.token_times:
        result.error = "the stream ended without a token"
    elif parsed.finish_reason is None:
        result.error = "the stream ended without a finish reason (cut off)"
    else:
        result.ok = True
    return result


# ----------------------------------------------------------------------------- one level

@dataclass
class Level:
    mode: str                          # "concurrency" or "rate"
    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"c={self.concurrency}"
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        cap = f", max {self.max_concurrency}" if self.max_concurrency else ""
        return f"rate={rate}/s{cap}"

    def to_dict(self) -> dict:
        d = {"mode": self.mode, "label": self.label}
        if self.mode == "concurrency":
            d["concurrency"] = self.concurrency
        else:
            d.update(request_rate=None if math.isinf(self.request_rate) else self.request_rate,
                     burstiness=self.burstiness, max_concurrency=self.max_concurrency)
        return d


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Gaps between ``n`` arrivals: gamma(shape=burstiness, mean=1/rate); burstiness 1 is Poisson."""
    if math.isinf(rate):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, file=sys.stderr, leave=True,
                dynamic_ncols=True)


TURN_SEPARATOR = "\n\n"


def make_items(source: PromptSource, count: int, input_len: int, output_len: int, input_range: float = 0.0,
               output_range: float = 0.0, shared_prefix: tuple[str, int] | None = None,
               turns: int = 1) -> list[list[tuple[str, int, int]]]:
    """Work for ``count`` requests: conversations of ``turns`` (question, its tokens, tokens to
    generate) each (one turn: independent prompts), every request starting with ``shared_prefix``
    (text, tokens) if given."""
    items = []
    for _ in range(-(-count // turns)):
        questions = source.batch(turns, input_len, input_range)
        if shared_prefix is not None:
            text, n = shared_prefix
            questions[0] = (text + " " + questions[0][0], n + questions[0][1])
        outputs = lengths_around(output_len, output_range, turns, source.rng)
        items.append([(question, qlen, out) for (question, qlen), out in zip(questions, outputs)])
    return items


async def _run_share(level: Level, backend: Backend, base_url: str, prompts: list[list[tuple[str, int, int]]],
                     headers: dict, *, request_timeout: float, max_duration: float,
                     seed: int, start_at: float, on_done=None) -> tuple[list[RequestResult], float, float]:
    """One process's share of a level, starting at ``start_at`` (a ``time.perf_counter()`` value,
    the same clock in every process). ``prompts``: conversations, each a list of turns (question,
    its tokens, tokens to generate); a turn sends the conversation so far (questions and answers)
    plus its question, after the previous turn ended. Returns (results, end time, CPU seconds used)."""
    url = base_url.rstrip("/") + backend.path
    width = max(1, level.concurrency or level.max_concurrency or len(prompts))
    connections = aiohttp.TCPConnector(limit=width, limit_per_host=width)
    timeout = aiohttp.ClientTimeout(total=request_timeout, connect=min(30.0, request_timeout))
    results: list[RequestResult] = []
    unparsed: list[Unparsed] = []
    async with aiohttp.ClientSession(connector=connections, timeout=timeout) as client:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        cpu0 = time.process_time()
        deadline = start_at + max_duration

        async def one(turns: list[tuple[str, int, int]]) -> None:
            history, history_len = "", 0
            for k, (question, qlen, max_tokens) in enumerate(turns):
                if k and time.perf_counter() >= deadline:
                    break
                prompt = history + question
                last = k == len(turns) - 1               # no later turn needs its text: parsed after the level
                result = await send_request(client, backend, url, prompt, history_len + qlen, max_tokens, headers,
                                            start_at, parse=not last)
                if isinstance(result, Unparsed):
                    unparsed.append(result)
                    result = result.result
                results.append(result)
                if on_done is not None:
                    on_done()
                if not result.ok:
                    break
                history = prompt + result.text + TURN_SEPARATOR
                history_len += qlen + result.output_tokens

        if level.mode == "concurrency":
            todo = iter(prompts)

            async def worker() -> None:
                for turns in todo:
                    if time.perf_counter() >= deadline:
                        break
                    await one(turns)

            await asyncio.gather(*(worker() for _ in range(min(level.concurrency, len(prompts)))))
        else:
            cap = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None

            async def limited(turns) -> None:
                if cap is None:
                    return await one(turns)
                async with cap:
                    await one(turns)

            tasks = []
            gaps = arrival_gaps(len(prompts), level.request_rate, level.burstiness, random.Random(seed))
            next_at = start_at
            for i, turns in enumerate(prompts):
                if i:
                    next_at += gaps[i - 1]
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.create_task(limited(turns)))
            await asyncio.gather(*tasks)
        t_end = time.perf_counter()
        cpu = time.process_time() - cpu0
    for pending in unparsed:
        parse_result(pending, backend)
    return results, t_end, cpu


def _share_in_process(kwargs: dict, channel, start, progress: bool):
    """Entry point of a worker process (``--workers``): say it is ready, wait for the common start
    time, run its share, and report each finished request when there is a progress bar."""
    channel.put("ready")
    while not start.value:
        time.sleep(0.002)
    on_done = (lambda: channel.put(1)) if progress else None
    return asyncio.run(_run_share(**kwargs, start_at=start.value, on_done=on_done))


def split_level(level: Level, workers: int) -> list[Level]:
    """The level as ``workers`` smaller ones whose sum is the whole: concurrency (or the cap on
    requests in flight) divided as evenly as possible, the request rate divided equally (the sum
    of independent Poisson processes is the Poisson process of the summed rate)."""
    def parts(total: int) -> list[int]:
        return [total // workers + (1 if i < total % workers else 0) for i in range(workers)]

    if level.mode == "concurrency":
        return [Level("concurrency", concurrency=c) for c in parts(level.concurrency)]
    caps = parts(level.max_concurrency) if level.max_concurrency else [None] * workers
    return [Level("rate", request_rate=level.request_rate / workers, burstiness=level.burstiness,
                  max_concurrency=cap) for cap in caps]


def run_level(level: Level, backend: Backend, base_url: str, prompts: list[list[tuple[str, int, int]]],
              headers: dict, *, request_timeout: float, max_duration: float,
              seed: int, progress: bool, workers: int = 1) -> tuple[list[RequestResult], float, float]:
    """Run ``prompts`` (conversations, see ``_run_share``) at one level, in this process or spread
    over ``workers`` processes (one
    Python process streams some 10-20 thousand tokens/s before its own CPU limits the numbers).
    Returns (results, duration in s, client CPU in cores)."""
    workers = max(1, min(workers, level.concurrency or level.max_concurrency or workers, len(prompts)))
    bar = _progress(sum(len(turns) for turns in prompts), level.label, progress)
    common = dict(backend=backend, base_url=base_url, headers=headers,
                  request_timeout=request_timeout, max_duration=max_duration)
    if workers == 1:
        start_at = time.perf_counter()
        results, t_end, cpu = asyncio.run(_run_share(
            level, prompts=prompts, seed=seed, start_at=start_at, **common,
            on_done=(lambda: bar.update(1)) if bar is not None else None))
        shares = [(results, t_end, cpu)]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as manager, ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            channel, start = manager.Queue(), manager.Value("d", 0.0)
            futures = [pool.submit(_share_in_process, dict(level=part, prompts=prompts[i::workers],
                                                           seed=seed * 1000 + i, **common),
                                   channel, start, bar is not None)
                       for i, part in enumerate(split_level(level, workers))]
            ready = 0
            while ready < workers:
                try:
                    ready += channel.get(timeout=1.0) == "ready"
                except queue.Empty:
                    if any(f.done() for f in futures):
                        break                # a worker failed before it was ready: its result says why
            start_at = time.perf_counter() + 0.05
            start.value = start_at
            if bar is not None:
                bar.reset()
            while bar is not None and not all(f.done() for f in futures):
                try:
                    bar.update(channel.get(timeout=0.2))
                except queue.Empty:
                    pass
            shares = [f.result() for f in futures]
    if bar is not None:
        bar.close()
    results = sorted((r for share in shares for r in share[0]), key=lambda r: r.start)
    duration = max(share[1] for share in shares) - start_at
    cpu = sum(share[2] for share in shares) / duration if duration > 0 else math.nan
    return results, duration, cpu


# ----------------------------------------------------------------------------- server helpers

def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """``python -m server`` on 127.0.0.1 for the duration of a run (``--serve``)."""

    def __init__(self, extra_args: list[str], port: int, log_path: Path, timeout: float):
        self.cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), *extra_args]
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LaunchedServer":
        log.info("starting %s (log: %s)", " ".join(self.cmd), self.log_path)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._stop()
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self._tail()}")
            try:
                resp = httpx.get(self.base_url + "/health", timeout=2.0, trust_env=False)
                if resp.status_code == 200:
                    return self
                error = resp.json().get("error") if resp.status_code == 503 else None
                if error:                  # loading failed: the server will not become healthy
                    self._stop()
                    raise RuntimeError(f"the server failed to start: {error}\n{self._tail()}")
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        self._stop()
        raise TimeoutError(f"the server was not healthy within {self.timeout:.0f} s:\n{self._tail()}")

    def _tail(self, n: int = 3000) -> str:
        return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __exit__(self, *exc) -> None:
        self._stop()


def fetch_json(base_url: str, path: str, headers: dict) -> dict | None:
    try:
        resp = httpx.get(base_url.rstrip("/") + path, headers=headers, timeout=10.0, trust_env=False)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def load_engine_rows(path: str | None, input_len: int | None = None, output_len: int | None = None) -> dict[int, float]:
    """The offline engine benchmark's tokens/s by batch size: ``{"ours": [{"batch", "tok_per_s"}]}``.
    Rows that name their ``prompt_len`` / ``new_tokens`` count only where those equal this run's
    lengths (the benchmark also writes long-context rows for the same batch sizes)."""
    if not path:
        return {}
    data = json.loads(Path(path).read_text())
    rows = data.get("ours") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of rows under the key 'ours'")
    out: dict[int, float] = {}
    skipped = 0
    for row in rows:
        if not isinstance(row, dict) or "batch" not in row or "tok_per_s" not in row:
            continue
        if ((input_len is not None and row.get("prompt_len", input_len) != input_len)
                or (output_len is not None and row.get("new_tokens", output_len) != output_len)):
            skipped += 1
            continue
        out.setdefault(int(row["batch"]), float(row["tok_per_s"]))
    if skipped:
        log.info("%s: %d rows of other prompt or output lengths are not compared", path, skipped)
    return out


# ----------------------------------------------------------------------------- the run

def parse_list(text: str, kind) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m load_tests.loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default=None,
                        help="server to load (default http://127.0.0.1:8000, or the --serve one)")
    target.add_argument("--backend", choices=sorted(BACKENDS), default="tgi",
                        help="tgi: /generate_stream; openai: /v1/completions; openai-chat: /v1/chat/completions")
    target.add_argument("--endpoint", default=None, help="override the backend's path")
    target.add_argument("--model", default=None, help="model name for OpenAI APIs (default: the first of /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("LOADGEN_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: env LOADGEN_API_KEY)")
    target.add_argument("--allow-remote", action="store_true",
                        help="allow a target that is not a loopback address (never needed for this project's tests)")
    target.add_argument("--serve", metavar="ARGS", default=None,
                        help="start 'python -m server --host 127.0.0.1 --port PORT ARGS' for the run and stop it after")
    target.add_argument("--serve-timeout", type=float, default=900.0, help="seconds to wait for /health")

    load = p.add_argument_group("load (give --concurrency or --request-rate)")
    load.add_argument("--concurrency", type=lambda s: parse_list(s, int), default=None,
                      help="comma-separated concurrencies to sweep, e.g. 1,16,64,256")
    load.add_argument("--request-rate", type=lambda s: parse_list(s, float), default=None,
                      help="comma-separated request rates per second (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrivals: 1 Poisson, <1 burstier, >1 more regular")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight in rate mode")
    load.add_argument("--num-prompts", type=int, default=None,
                      help="requests per level (default: max(16, 8 x concurrency); 100 per rate)")
    load.add_argument("--warmup", type=int, default=2, help="requests sent (and checked) before measuring")
    load.add_argument("--max-duration", type=float, default=600.0,
                      help="seconds after which a level sends no new request")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    load.add_argument("--workers", type=int, default=1,
                      help="client processes sharing each level (one streams some 10-20k tokens/s)")
    load.add_argument("--seed", type=int, default=0)

    req = p.add_argument_group("requests")
    req.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    req.add_argument("--input-range", type=float, default=0.0,
                     help="prompt lengths drawn uniformly in input-len x [1-r, 1+r]")
    req.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    req.add_argument("--output-range", type=float, default=0.0,
                     help="output lengths drawn uniformly in output-len x [1-r, 1+r], per request (with "
                          "one length for all, streams that start together finish together and stay in step)")
    req.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                     help="every request starts with the same N tokens, then --input-len of its own")
    req.add_argument("--multi-turn", type=int, default=1, metavar="TURNS",
                     help="conversations of TURNS requests: each turn resends the conversation so far "
                          "(questions and answers) plus a new question of --input-len tokens")
    req.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                     help="do not send ignore_eos (for servers that reject it; lengths then vary)")
    req.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    req.add_argument("--logprobs", action="store_true",
                     help="OpenAI backends: ask for logprobs, so that every chunk lists its tokens and the "
                          "streamed count is exact (costs the server a little)")
    req.add_argument("--tokenizer", default="auto",
                     help="'auto' (the embedded model's, if installed), 'none' (approximate lengths), "
                          "or a tokenizer folder / .gguf file")

    rep = p.add_argument_group("report")
    rep.add_argument("--out-dir", default=None, help="default results/loadgen-<time>")
    rep.add_argument("--label", default=None, help="title of the report")
    rep.add_argument("--percentiles", type=lambda s: parse_list(s, float), default=[50.0, 90.0, 99.0])
    rep.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=None,
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)")
    rep.add_argument("--engine-json", default=None,
                     help="offline engine benchmark JSON ({'ours': [{'batch', 'tok_per_s'}]}) to compare with")
    rep.add_argument("--engine-ratio-target", type=float, default=0.6,
                     help="HTTP tokens/s that must reach this fraction of the engine's")
    rep.add_argument("--no-plots", action="store_true")
    rep.add_argument("--no-progress", action="store_true")
    rep.add_argument("--no-requests", action="store_true", help="leave per-request records out of the JSON")
    rep.add_argument("--strict", action="store_true",
                     help="exit 1 on any failed request, token-count mismatch or missed engine ratio")
    return p


def make_levels(args) -> list[Level]:
    if (args.concurrency is None) == (args.request_rate is None):
        raise SystemExit("give exactly one of --concurrency and --request-rate")
    if args.concurrency is not None:
        if any(c < 1 for c in args.concurrency):
            raise SystemExit("concurrencies must be >= 1")
        return [Level("concurrency", concurrency=c) for c in args.concurrency]
    if any(r <= 0 for r in args.request_rate) or args.burstiness <= 0:
        raise SystemExit("request rates and burstiness must be > 0")
    return [Level("rate", request_rate=r, burstiness=args.burstiness, max_concurrency=args.max_concurrency)
            for r in args.request_rate]


def level_size(level: Level, args) -> int:
    if args.num_prompts is not None:
        return args.num_prompts
    return max(16, 8 * level.concurrency) if level.mode == "concurrency" else 100


def benchmark(args, base_url: str, headers: dict, source: PromptSource, backend: Backend,
              levels: list[Level], slos: dict) -> list[dict]:
    prefix = (source.make(args.shared_prefix), args.shared_prefix) if args.shared_prefix else None
    if args.warmup > 0:
        prompts = make_items(source, args.warmup, args.input_len, args.output_len, shared_prefix=prefix)
        warm, _, _ = run_level(Level("concurrency", concurrency=args.warmup), backend, base_url, prompts,
                               headers, request_timeout=args.request_timeout,
                               max_duration=args.request_timeout, seed=args.seed, progress=False)
        bad = [r for r in warm if not r.ok]
        if bad:
            hint = " (does the server accept ignore_eos? try --no-ignore-eos)" if bad[0].status in (400, 422) else ""
            raise RuntimeError(f"warm-up request failed: {bad[0].error}{hint}")
        if warm[0].prompt_tokens_reported and backend.name != "openai-chat":
            source.calibrate(prompts[0][0][0], warm[0].prompt_tokens_reported)
        log.info("warm-up: %d requests ok, %d tokens each", len(warm), warm[0].output_tokens)

    out = []
    for i, level in enumerate(levels):
        prompts = make_items(source, level_size(level, args), args.input_len, args.output_len, args.input_range,
                             args.output_range, prefix, args.multi_turn)
        results, duration, cpu = run_level(
            level, backend, base_url, prompts, headers,
            request_timeout=args.request_timeout, max_duration=args.max_duration,
            seed=args.seed + i, progress=not args.no_progress, workers=args.workers)
        summary = summarize(results, duration, args.percentiles, slos, expect_length=args.ignore_eos,
                            exact_count=backend.exact_count)
        summary["client_cpu_cores"] = cpu
        s = summary
        log.info("%s: %d/%d ok in %.1f s, %.1f req/s, %.1f output tok/s, TTFT p50 %.1f ms, ITL p50 %.2f ms%s",
                 level.label, s["completed"], s["requests"], duration, s["request_throughput"],
                 s["output_throughput"], s["ttft_ms"].get("p50", math.nan), s["itl_ms"].get("p50", math.nan),
                 "" if s["cached_prompt_share"] is None else f", {s['cached_prompt_share']:.0%} of prompt tokens cached")
        if cpu > 0.8 * args.workers and duration > 2.0:
            log.warning("%s: the load generator used %.0f%% of %d core(s); its own overhead may limit the "
                        "numbers: spread it over more processes (--workers)", level.label, cpu * 100, args.workers)
        out.append({"level": level.to_dict(), "summary": summary, "results": results})
    return out


def run(args) -> int:
    from . import report

    levels = make_levels(args)
    slos = parse_slos(args.goodput)
    engine = load_engine_rows(args.engine_json, args.input_len, args.output_len)
    if args.input_len < 1 or args.output_len < 1 or args.workers < 1 or args.multi_turn < 1:
        raise SystemExit("--input-len, --output-len, --workers and --multi-turn must be >= 1")
    if args.shared_prefix < 0:
        raise SystemExit("--shared-prefix must be >= 0")
    if not (0 <= args.input_range < 1 and 0 <= args.output_range < 1):
        raise SystemExit(f"--input-range and --output-range must be in [0, 1), not {args.input_range} "
                         f"and {args.output_range}")

    out_dir = Path(args.out_dir or f"results/loadgen-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    server = None
    if args.serve is not None:
        import shlex
        port = urllib.parse.urlsplit(args.base_url).port if args.base_url else None
        server = LaunchedServer(shlex.split(args.serve), port or free_port(), out_dir / "server.log",
                                args.serve_timeout)
        base_url = server.base_url
    else:
        base_url = args.base_url or "http://127.0.0.1:8000"
    host = urllib.parse.urlsplit(base_url).hostname or ""
    if not args.allow_remote and not is_loopback(host):
        raise SystemExit(f"{host!r} is not a loopback address: pass --allow-remote to load a remote server")
    out_dir.mkdir(parents=True, exist_ok=True)

    t_tok = time.monotonic()
    source = PromptSource(load_tokenizer(args.tokenizer), seed=args.seed)
    log.info("prompts: %s token lengths (tokenizer ready in %.1f s)",
             "exact" if source.exact else "approximate", time.monotonic() - t_tok)

    started = datetime.now(timezone.utc)
    if server is not None:
        server.__enter__()
    try:
        models = fetch_json(base_url, "/v1/models", headers)
        model = args.model
        if model is None and models and models.get("data"):
            model = models["data"][0].get("id")
        backend_cls = BACKENDS[args.backend]
        if backend_cls.needs_model and not model:
            raise SystemExit("no --model given and /v1/models named none")
        backend = backend_cls(model=model, ignore_eos=args.ignore_eos, temperature=args.temperature,
                              path=args.endpoint, logprobs=args.logprobs)
        health = fetch_json(base_url, "/health", headers)
        levels_out = benchmark(args, base_url, headers, source, backend, levels, slos)
    finally:
        if server is not None:
            server.__exit__(None, None, None)

    config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    config.update(base_url=base_url, endpoint=backend.path, model=model,
                  prompt_lengths="exact" if source.exact else "approximate",
                  tokens_per_word=None if source.exact else source.tokens_per_word, slos_ms=slos)
    doc = {
        "created": started.isoformat(timespec="seconds"),
        "label": args.label or f"{args.backend} {base_url}",
        "config": config,
        "client": {"python": platform.python_version(), "aiohttp": aiohttp.__version__,
                   "host": platform.node(), "cpus": os.cpu_count()},
        "server": {"health": health, "models": models},
        "engine": {"source": args.engine_json, "tok_per_s_by_batch": engine,
                   "ratio_target": args.engine_ratio_target} if engine else None,
        "levels": [{"level": lv["level"], "summary": lv["summary"],
                    **({} if args.no_requests else {"requests": [r.to_dict() for r in lv["results"]]})}
                   for lv in levels_out],
    }
    report.add_engine_comparison(doc)
    paths = report.write_all(doc, out_dir, plots=not args.no_plots, raw=[lv["results"] for lv in levels_out])
    print(paths["markdown_text"])
    for name, path in paths.items():
        if name != "markdown_text":
            log.info("wrote %s", path)

    if args.strict:
        problems = report.problems(doc)
        for problem in problems:
            log.error("%s", problem)
        return 1 if problems else 0
    return 0 if any(lv["summary"]["completed"] for lv in doc["levels"]) else 1


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (RuntimeError, TimeoutError, ValueError, OSError) as exc:
        log.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
