"""Where a call's time goes inside the split kernel: ``python -m kernels.timeline [--out FILE]``.

Builds the diagnostic variant of the extension (``-DFLASHDECODE_TIMELINE``), whose split kernel
records, per block, the SM clock at each stage of its chain: entry, past the PDL wait, sequence
length loaded, block-table slice loaded (producer), first tile arrived (consumer), main loop
done (consumer warp 0), the epilogue's two block barriers, rows stored, and with a cluster merge
its first barrier and the merge itself; then exit. It also sums the time consumer warp 0 waited
for data after its first tile and the time the producer waited for a free stage: a consumer that
rarely waits is what sets the pace, not the memory. For each case it makes the L2 cold (a 256 MB write), runs one call of
the default launch plan, and prints the median over blocks of each stage's time since the block
began, beside the call's time under CUDA-graph replay (bench.py's method, same build) and the
span from the first block's entry to the last block's exit. What is left of the graph time
after the span is launch, drain and, with more than 16 splits, the merge kernel. ``--warm``
reads the stamps of the last call of a replayed graph instead: calls back to back, as bench.py
times them; with ``--blocks`` it also prints when each stage happened across the blocks (percentiles
of absolute time, per split index), which shows a grid's tail. ``--copy-only`` runs a variant whose consumers release every tile unread (wrong
output): what the memory path and the fixed costs take without the arithmetic.
"""

import argparse
import json
import statistics

import torch

from . import bench, build, ops
from .paging import DEFAULT_BLOCK_SIZE

STAGES = ("waited", "length", "table", "first_tile", "loop_done", "synced", "reduced", "stored", "cluster_synced",
          "merged", "exit")
ENTRY, EXIT, ENTRY_NS, EXIT_NS, CONSUMER_WAITS, PRODUCER_WAITS = 0, 11, 12, 13, 14, 15
WAITS = ("consumer_wait", "producer_wait")
CASES = (((9, 3, 64), 1, 512), ((9, 3, 64), 1, 4096), ((9, 3, 64), 1, 32768), ((9, 3, 64), 8, 4096),
         ((9, 3, 64), 64, 512), ((32, 8, 128), 1, 4096), ((32, 8, 128), 8, 512), ((32, 8, 128), 8, 4096),
         ((9, 3, 64), 8, 32768), ((9, 3, 64), 64, 4096))


def one_call(call, blocks, flush):
    torch.ops.flashdecode.read_timeline(True)
    flush.zero_()
    call()
    torch.cuda.synchronize()
    return read_stamps(blocks)


def last_of_graph(graph, blocks):
    """The stamps of the last call of a replayed graph of calls: warm, with its predecessor's
    tail overlapping its start (PDL), as under bench.py's timing."""
    torch.ops.flashdecode.read_timeline(True)
    graph.replay()
    torch.cuda.synchronize()
    return read_stamps(blocks)


def read_stamps(blocks):
    stamps = torch.ops.flashdecode.read_timeline(False)[:blocks].tolist()
    ran = [s for s in stamps if s[EXIT]]
    ghz = clock_ghz(ran)
    stages = {}
    for i, name in enumerate(STAGES, start=1):
        done = [(s[i] - s[ENTRY]) / ghz / 1e3 for s in ran if s[i]]
        stages[name] = statistics.median(done) if done else float("nan")
    for i, name in zip((CONSUMER_WAITS, PRODUCER_WAITS), WAITS):
        stages[name] = statistics.median(s[i] / ghz / 1e3 for s in ran)
    span_us = (max(s[EXIT_NS] for s in ran) - min(s[ENTRY_NS] for s in ran)) / 1e3
    return stages, span_us, ghz


def clock_ghz(ran):
    # %globaltimer ticks coarsely: the clock rate from all blocks together
    return sum(s[EXIT] - s[ENTRY] for s in ran) / max(sum(s[EXIT_NS] - s[ENTRY_NS] for s in ran), 1)


def spread_over_blocks(blocks, splits):
    """Per stage and split index: percentiles (0, 10, 50, 90, 100) of when it happened, us after the
    earliest block passed its PDL wait. A block's SM clock is placed on the global timer by its entry."""
    stamps = torch.ops.flashdecode.read_timeline(False)[:blocks].tolist()
    ran = [(i, s) for i, s in enumerate(stamps) if s[EXIT]]
    ghz = clock_ghz([s for _, s in ran])

    def at(s, stage):
        return s[ENTRY_NS] + (s[stage] - s[ENTRY]) / ghz

    zero = min(at(s, 1) for _, s in ran if s[1])
    rows = {}
    for index in [None] + list(range(splits)):
        for i, name in enumerate(STAGES, start=1):
            times = sorted((at(s, i) - zero) / 1e3 for b, s in ran if s[i] and (index is None or b % splits == index))
            if times:
                rows[f"{'all' if index is None else f'split {index}'} {name}"] = [
                    times[min(len(times) - 1, int(q * len(times)))] for q in (0, 0.1, 0.5, 0.9, 1.0)]
    return rows


def parse_case(text):
    shape, batch, seq_len = text.split(":")
    return tuple(int(x) for x in shape.split("/")), int(batch), int(seq_len)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ring-stages", type=int, default=0, help="ring depth to run (0: the launcher's choice)")
    parser.add_argument("--warm", action="store_true",
                        help="stamps of the last call of a replayed graph of calls (warm L2 for the tables, the "
                             "previous call's tail overlapping) instead of one call after a cold L2")
    parser.add_argument("--copy-only", action="store_true",
                        help="consumers release every tile unread (wrong output): what the memory path, the "
                             "epilogue and the merge cost without the arithmetic")
    parser.add_argument("--only", action="append", type=parse_case, default=None, metavar="HQ/HKV/D:B:M",
                        help="run only this case (repeatable)")
    parser.add_argument("--blocks", action="store_true",
                        help="with --warm: also print when each stage happened across the blocks, per split index")
    args = parser.parse_args(argv)
    if args.blocks and not args.warm:
        parser.error("--blocks reads the last call of a replayed graph: add --warm")
    device = torch.device("cuda")
    build.load_extension(timeline=True, copy_only=args.copy_only)
    ops.load(device)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    rows = []
    print("us since the block began (median over blocks, median of repeats); graph = bench.py's per-call time")
    print("| case | S | blocks | graph us | span us | " + " | ".join(STAGES + WAITS) + " |")
    print("|---" * (len(STAGES) + len(WAITS) + 5) + "|")
    for shape, batch, seq_len in args.only or CASES:
        case = bench.Case(shape, batch, seq_len, DEFAULT_BLOCK_SIZE, device)
        splits = case.workspace.num_splits(batch)
        blocks = min(splits * shape[1] * -(-(shape[0] // shape[1]) // ops.HEADS_PER_BLOCK) * batch, 4096)
        calls = case.ours(ring_stages=args.ring_stages)
        graph_us = bench.time_per_call_us(calls)
        if args.warm:
            graph = bench.capture_calls(calls, 24)
            graph.replay()
            runs = [last_of_graph(graph, blocks) for _ in range(args.repeats)]
            spread = spread_over_blocks(blocks, splits) if args.blocks else None
            del graph
        else:
            runs = [one_call(calls[i % len(calls)], blocks, flush) for i in range(args.repeats)]
        stages = {n: statistics.median(r[0][n] for r in runs) for n in STAGES + WAITS}
        span = statistics.median(r[1] for r in runs)
        label = f"{'/'.join(map(str, shape))} B={batch} M={seq_len}"
        rows.append({"case": label, "splits": splits, "blocks": blocks, "graph_us": graph_us, "span_us": span,
                     "stages_us": stages, "sm_ghz": statistics.median(r[2] for r in runs)})
        if args.blocks:  # implies --warm
            rows[-1]["over_blocks_us"] = spread
        print(f"| {label} | {splits} | {blocks} | {graph_us:.1f} | {span:.1f} | "
              + " | ".join(f"{stages[n]:.2f}" for n in STAGES + WAITS) + " |", flush=True)
        if args.blocks:
            print(f"  {label}, last call of the graph: us after the first PDL release; percentiles 0/10/50/90/100")
            for key, values in spread.items():
                if any(word in key for word in ("waited", "first_tile", "loop_done", "exit")):
                    print(f"    {key:24s} " + " ".join(f"{v:7.2f}" for v in values))
        del case
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
