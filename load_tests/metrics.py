"""Per-request records and the summary of one load level, with vLLM's serving-benchmark definitions:

- TTFT, time to first token: from sending the request to the first token chunk.
- TPOT, time per output token: per request, (latency - TTFT) / (output tokens - 1).
- ITL, inter-token latency: every gap between two token chunks of a request, over all requests.
- E2EL, end-to-end latency: from sending the request to the end of its stream.
- Throughput: completed requests, output tokens and all tokens divided by the level's duration
  (first request sent to last response finished).
- Goodput: completed requests per second that met every SLO given (TTFT, TPOT, E2EL, in ms).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    prompt_len: int                           # tokens the prompt was made to have
    max_tokens: int                           # tokens asked for
    start: float = 0.0                        # seconds after the level started
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None                 # seconds
    latency: float | None = None              # seconds
    itl: list[float] = field(default_factory=list)
    tokens_counted: int = 0                   # tokens streamed (see backends.py)
    chunks: int = 0                           # stream chunks that carried them
    tokens_reported: int | None = None        # the server's count
    prompt_tokens_reported: int | None = None
    cached_tokens_reported: int | None = None  # prompt tokens the server found in its prefix cache
    finish_reason: str | None = None
    text_chars: int = 0
    text: str = field(default="", repr=False)  # the generated text (a multi-turn chat resends it)

    @property
    def output_tokens(self) -> int:
        return self.tokens_reported if self.tokens_reported is not None else self.tokens_counted

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens_reported if self.prompt_tokens_reported is not None else self.prompt_len

    @property
    def tpot(self) -> float | None:
        if self.latency is None or self.ttft is None:
            return None
        n = self.output_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["text"]
        return out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values_s: list[float], percentiles: list[float]) -> dict:
    """mean, std and percentiles in milliseconds (NaN where there are no values)."""
    ms = [v * 1000.0 for v in values_s]
    n = len(ms)
    mean = sum(ms) / n if n else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / n) if n else math.nan
    out = {"count": n, "mean": mean, "std": std}
    for q in percentiles:
        out[f"p{q:g}"] = percentile(ms, q)
    out["max"] = max(ms) if ms else math.nan
    return out


def parse_slos(specs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"SLO {spec!r} is not NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {spec!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"SLO {spec!r}: the bound must be positive")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    return r.ok and all(values[k] is not None and values[k] * 1000.0 <= bound for k, bound in slos.items())


def token_check(results: list[RequestResult], expect_length: bool, exact_count: bool = True) -> dict:
    """Tokens streamed against the server's own count, and (with ignore_eos) against the number of
    tokens asked for. Where the stream may carry several tokens in one chunk (``exact_count``
    False), only more tokens streamed than reported is a mismatch; fewer is counted apart."""
    ok = [r for r in results if r.ok]
    reported = [r for r in ok if r.tokens_reported is not None]
    if exact_count:
        mismatched, merged = [r for r in reported if r.tokens_reported != r.tokens_counted], []
    else:
        mismatched = [r for r in reported if r.tokens_counted > r.tokens_reported]
        merged = [r for r in reported if r.tokens_counted < r.tokens_reported]
    short = [r for r in ok if r.output_tokens != r.max_tokens] if expect_length else []
    return {"exact": exact_count, "checked": len(reported), "not_reported": len(ok) - len(reported),
            "mismatched": len(mismatched), "multi_token_chunks": len(merged),
            "not_requested_length": len(short),
            "examples": [{"counted": r.tokens_counted, "reported": r.tokens_reported,
                          "requested": r.max_tokens} for r in (mismatched + short)[:5]]}


def cached_share(ok: list[RequestResult]) -> float | None:
    """Share of the prompt tokens the server said it found in its prefix cache (None: it said nothing)."""
    told = [r for r in ok if r.cached_tokens_reported is not None]
    prompt = sum(r.input_tokens for r in told)
    return sum(r.cached_tokens_reported for r in told) / prompt if told and prompt else None


def summarize(results: list[RequestResult], duration: float, percentiles: list[float],
              slos: dict[str, float], expect_length: bool, exact_count: bool = True) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    good = [r for r in ok if meets_slos(r, slos)] if slos else ok
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.error or "unknown error")[:200]
        errors[key] = errors.get(key, 0) + 1
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "goodput": per_s(len(good)) if slos else None,
        "slo_attainment": (len(good) / len(results) if results else math.nan) if slos else None,
        "ttft_ms": describe([r.ttft for r in ok if r.ttft is not None], percentiles),
        "tpot_ms": describe([r.tpot for r in ok if r.tpot is not None and r.output_tokens > 1], percentiles),
        "itl_ms": describe([gap for r in ok for gap in r.itl], percentiles),
        "e2el_ms": describe([r.latency for r in ok if r.latency is not None], percentiles),
        "mean_prompt_tokens": in_tokens / len(ok) if ok else math.nan,
        "cached_prompt_share": cached_share(ok),
        "mean_output_tokens": out_tokens / len(ok) if ok else math.nan,
        "token_check": token_check(results, expect_length, exact_count),
        "errors": errors,
    }
