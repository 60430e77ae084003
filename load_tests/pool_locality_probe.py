"""Does where a sequence's blocks lie in the KV pool change the decode step's time?

Decode step alone (CUDA graph replay, median GPU time): B sequences of CTX cached tokens whose
blocks are the pool's first ones in order ("compact", as a fresh pool or a LIFO free list hands
out) against blocks drawn at random over the whole pool ("scattered", as an LRU queue of cached
blocks hands out once the pool is full). Then the engine alone, nothing shared, caching off, a
closed loop of B streams: free list as built against shuffled.

    python -m load_tests.pool_locality_probe --model random:llama-gqa128 --num-blocks 26000
"""

import argparse
import random
import statistics

import torch

from kernels.bench import replay_us
from load_tests.engine_bench import random_prompts, run_closed_loop
from models import load_model
from server.engine import EngineConfig, EngineCore, SamplingParams
from server.engine.sequence import Sequence


def step_us(core, batch, context, tables, replays=100):
    seqs = []
    for i in range(batch):
        seq = Sequence(f"s{i}", [100 + (i * 31 + j) % 20000 for j in range(context - 1)], SamplingParams(), 0)
        seq.num_cached = seq.length
        seq.append(7)
        seq.block_table = list(tables[i])
        seqs.append(seq)
    with torch.inference_mode():
        core.runner.decode(seqs)
    graph = core.runner.graphs[core.runner.bucket_for(batch)][0]
    for _ in range(5):
        graph.replay()
    return replay_us(graph, replays)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-gqa128")
    ap.add_argument("--num-blocks", type=int, default=26000)
    ap.add_argument("--cases", nargs="+", default=["64:384", "256:384", "64:2048"])
    ap.add_argument("--loop-streams", type=int, default=64)
    ap.add_argument("--loop-requests", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    loaded = load_model(args.model, device="cuda")
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases]
    config = EngineConfig(max_batch=max(b for b, _ in cases), max_model_len=2560, num_blocks=args.num_blocks,
                          graph_buckets=tuple(sorted({b for b, _ in cases} | {args.loop_streams})),
                          prefill_graph_buckets=(), prefix_caching=False)
    core = EngineCore(loaded, config, publish=lambda pairs, stats: None)
    bs = core.runner.block_size
    rng = random.Random(0)
    print(f"{args.model}: pool of {core.blocks.num_blocks} blocks of {bs} tokens")
    print("| B | context | compact us | scattered us | scattered / compact |\n|---:|---:|---:|---:|---:|")
    for batch, context in cases:
        per = -(-(context + 1) // bs)
        compact = [range(i * per, (i + 1) * per) for i in range(batch)]
        times = {"compact": [], "scattered": []}
        for _ in range(args.repeats):
            drawn = rng.sample(range(core.blocks.num_blocks), batch * per)
            scattered = [drawn[i * per:(i + 1) * per] for i in range(batch)]
            times["compact"].append(step_us(core, batch, context, compact))
            times["scattered"].append(step_us(core, batch, context, scattered))
        c, s = statistics.median(times["compact"]), statistics.median(times["scattered"])
        print(f"| {batch} | {context} | {c:.1f} | {s:.1f} | {s / c:.3f} |", flush=True)

    vocab = loaded.config.vocab_size
    built = list(core.blocks._empty)
    shuffled = built[:]
    rng.shuffle(shuffled)
    loops = {"as built": [], "shuffled": []}
    for r in range(args.repeats):
        prompts = random_prompts(args.loop_requests, 128, vocab, seed=r)
        for name, order in (("as built", built), ("shuffled", shuffled)):
            core.blocks._empty[:] = order
            elapsed, _ = run_closed_loop(core, prompts, 256, args.loop_streams)
            loops[name].append(args.loop_requests * 256 / elapsed)
    a, s = statistics.median(loops["as built"]), statistics.median(loops["shuffled"])
    print(f"closed loop, {args.loop_streams} streams, 128 in / 256 out, caching off: free list as built "
          f"{a:,.0f} tok/s, shuffled {s:,.0f} tok/s, shuffled / as built {s / a:.3f} "
          f"(runs: {[round(x) for x in loops['as built']]} / {[round(x) for x in loops['shuffled']]})")


if __name__ == "__main__":
    main()
