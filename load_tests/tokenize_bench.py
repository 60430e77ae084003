"""Prompt encoding on this host: transformers' ``encode``, the backend on the whole text, and the
server's encoder (``server.encoding``) with prefix caching off (a long prompt's pieces encoded side
by side) and on (a prompt's start that a kept prompt shared not encoded again), on the same
load-generator prompts, with 1 and with C concurrent callers (threads, as the API worker's pool).
A case ``S:N`` is prompts of N tokens of their own after S tokens they all share.

    python -m load_tests.tokenize_bench --cases 0:128 0:2176 2048:128 --callers 1 4 16
"""

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from models import load_tokenizer
from server.encoding import CACHED_PROMPTS, PromptEncoder

from .prompts import PromptSource


def median_ms(ways: dict, texts: list[str], callers: int, repeats: int) -> dict[str, float]:
    """Each way's median latency of a call, from the moment ``callers`` calls are handed to as many
    threads at once to its end (a wait for the GIL or for the tokenizer's thread pool counts). The
    ways take turns, wave by wave."""
    times = {way: [] for way in ways}
    with ThreadPoolExecutor(callers) as pool:
        for wave in range(repeats + 1):
            for way, fn in ways.items():
                def finish(i, fn=fn):
                    fn(texts[(wave * callers + i) % len(texts)])
                    return time.perf_counter()
                started = time.perf_counter()
                ends = list(pool.map(finish, range(callers)))
                if wave:                                             # the first wave warms up
                    times[way] += [end - started for end in ends]
    return {way: statistics.median(t) * 1e3 for way, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="whose tokenizer (a model spec)")
    parser.add_argument("--cases", nargs="+", default=["0:128", "0:2176", "2048:128"], metavar="S:N")
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompts", type=int, default=2 * CACHED_PROMPTS,
                        help="distinct prompts per case, taken in turn: more than the encoder keeps, so that "
                             "what it finds again is the shared start, not the same prompt")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    backend = tokenizer.backend_tokenizer
    pieces, kept = PromptEncoder(tokenizer), PromptEncoder(tokenizer, cached_prompts=CACHED_PROMPTS)
    ways = {
        "transformers encode": lambda t: tokenizer.encode(t),
        "backend, whole": lambda t: backend.encode_batch_fast([t])[0].ids,
        "server, caching off": lambda t: pieces.encode(t, True),
        "server, caching on": lambda t: kept.encode(t, True),
    }
    print(f"| shared + own tokens | callers | {' | '.join(f'{w}, ms' for w in ways)} | whole / off | whole / on |")
    print(f"|---|---:|{'---:|' * len(ways)}---:|---:|")
    source = PromptSource(tokenizer, seed=0)
    for case in args.cases:
        shared, own = (int(n) for n in case.split(":"))
        start = source.make(shared) if shared else ""
        texts = [start + source.make(own) for _ in range(args.prompts)]
        for text in texts:
            expected = tokenizer.encode(text)
            assert pieces.encode(text, True) == expected and kept.encode(text, True) == expected, \
                "the encoder's ids differ"
        for callers in args.callers:
            ms = median_ms(ways, texts, callers, args.repeats)
            print(f"| {shared} + {own} | {callers} | {' | '.join(f'{v:.2f}' for v in ms.values())} | "
                  f"{ms['backend, whole'] / ms['server, caching off']:.2f}x | "
                  f"{ms['backend, whole'] / ms['server, caching on']:.2f}x |")


if __name__ == "__main__":
    main()
