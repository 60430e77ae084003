"""How many prompt tokens a CPU prefill step takes: as many as fit a target step time.

On the CPU a prefill step runs for as long as its tokens take (4,000 tokens froze every stream
for 19 s), so the scheduler sizes each chunk by time instead of by a fixed token count. A chunk
of ``n`` tokens after ``c`` cached ones costs about ``n (a + b (c + n / 2))`` seconds: ``a`` for
the projections of each token, ``b`` for each key it attends to. The engine measures ``a`` and
``b`` at start-up (``measure``), once, so the same prompt is always cut into the same chunks.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

PROBE_TOKENS = 64           # the chunk timed at start-up, at two contexts
PROBE_CONTEXT = 2048        # the longer context (capped by the pool)


@dataclass(frozen=True)
class PrefillCost:
    per_token_s: float        # a: projections, norms, the token's own work
    per_key_s: float          # b: attention, per token and key attended to

    def seconds(self, tokens: int, context: int) -> float:
        """Estimated time of a chunk of ``tokens`` after ``context`` cached ones."""
        return tokens * (self.per_token_s + self.per_key_s * (context + tokens / 2))

    def tokens_within(self, seconds: float, context: int) -> int:
        """The most tokens after ``context`` cached ones that fit in ``seconds``."""
        if seconds <= 0:
            return 0
        a, b = self.per_token_s + self.per_key_s * context, self.per_key_s / 2
        if b <= 0:
            return int(seconds / a) if a > 0 else 1 << 30
        return int((-a + math.sqrt(a * a + 4 * b * seconds)) / (2 * b))


def measure(prefill_seconds: Callable[[int, int], float], kv_tokens: int) -> PrefillCost:
    """Fits ``PrefillCost`` to the time of a ``PROBE_TOKENS`` chunk at no context and after
    ``PROBE_CONTEXT`` cached tokens (the best of two runs each, after one throwaway run), both
    within ``kv_tokens``; ``prefill_seconds(tokens, context)`` runs one such chunk."""
    n = max(1, min(PROBE_TOKENS, kv_tokens))
    context = max(0, min(PROBE_CONTEXT, kv_tokens - n))
    prefill_seconds(n, 0)
    short = min(prefill_seconds(n, 0) for _ in range(2))
    if context == 0:
        return PrefillCost(short / n, 0.0)
    long = min(prefill_seconds(n, context) for _ in range(2))
    per_key = max(0.0, (long - short) / (n * context))
    per_token = max(short / n - per_key * n / 2, 1e-9)
    return PrefillCost(per_token, per_key)
