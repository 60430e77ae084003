"""Prompt encoding on this host: transformers' ``encode``, the backend on the whole text, and the
server's encoder (``server.encoding``: a long prompt's pieces encoded side by side), on the same
load-generator prompts, with 1 and with C concurrent callers (threads, as the API worker's pool).

    python -m load_tests.tokenize_bench --tokens 128 2176 --callers 1 4 16
"""

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from models import load_tokenizer
from server.encoding import PromptEncoder

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
                    fn(texts[(wave + i) % len(texts)])
                    return time.perf_counter()
                started = time.perf_counter()
                ends = list(pool.map(finish, range(callers)))
                if wave:                                             # the first wave warms up
                    times[way] += [end - started for end in ends]
    return {way: statistics.median(t) * 1e3 for way, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="whose tokenizer (a model spec)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 2176])
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    encoder = PromptEncoder(tokenizer)
    backend = tokenizer.backend_tokenizer
    ways = {
        "transformers encode": lambda t: tokenizer.encode(t),
        "backend, whole": lambda t: backend.encode_batch_fast([t])[0].ids,
        "server (pieces)": lambda t: encoder.encode(t, True),
    }
    print(f"| tokens | callers | pieces | {' | '.join(f'{w}, ms' for w in ways)} | whole / pieces |")
    print(f"|---:|---:|---:|{'---:|' * len(ways)}---:|")
    source = PromptSource(tokenizer, seed=0)
    for length in args.tokens:
        texts = [source.make(length) for _ in range(args.prompts)]
        for text in texts:
            assert encoder.encode(text, True) == tokenizer.encode(text), "the encoder's ids differ"
        for callers in args.callers:
            ms = median_ms(ways, texts, callers, args.repeats)
            pieces = len(encoder.pieces(texts[0]))
            print(f"| {length} | {callers} | {pieces} | {' | '.join(f'{v:.2f}' for v in ms.values())} | "
                  f"{ms['backend, whole'] / ms['server (pieces)']:.2f}x |")


if __name__ == "__main__":
    main()
