"""Kernel benchmark: ``python -m benchmarks.kernel_bench [--out DIR]``.

For each shape (Hq/Hkv/D), batch and length of the grid (bf16), times our paged flash decode
and PyTorch SDPA's cuDNN and flash backends on contiguous ``[B, Hkv, M, D]`` KV with
``enable_gqa=True``. Every implementation is timed the same way: CUDA-graph replay of at least
20 calls that rotate over enough input sets to stream well past the 60 MB L2, median over
replays, per call. Writes ``bench.json`` and ``bench.png`` under ``--out`` and prints a Markdown
table plus the geometric means the targets name. ``--repeat`` times each case several times,
interleaved; ``--only``, ``--shapes``, ``--batches``, ``--lengths``, ``--quick`` and ``--max-kv-mb``
leave out cases. ``--window W`` also times our kernel with a sliding window of W on every case
longer than W (its planned span and reads are the window's), beside the unwindowed call. It also
times the launch floor: one and two trivial kernels per call, replayed the same way. ``--int8``
adds our kernel on int8 caches of the same values (a scale per token and KV head) and a table of
its speedup over our bf16 kernel and over cuDNN bf16 (issue 49's targets), and with ``--window``
the windowed call on int8 caches too; ``--peers`` picks the SDPA backends.
"""

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import constants, ops
from kernels.kv_quant import quantize_rows
from kernels.paging import DEFAULT_BLOCK_SIZE, pack_paged
from kernels.workspace import Workspace

SHAPES = ((9, 3, 64), (32, 8, 128), (4, 1, 256))   # SmolLM2-135M, Llama-3-8B, Gemma-3-270M/1B
BATCHES = (1, 8, 64)
LENGTHS = (512, 4096, 32768, 131072)
PEAK_BYTES_PER_S = 4.5e12
MAX_KV_BYTES = 20e9
ROTATE_BYTES = 256e6
MIN_CALLS_PER_GRAPH = 20
PEERS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def kv_bytes(batch, num_kv_heads, seq_len, head_dim, elem=2):
    return 2 * batch * num_kv_heads * seq_len * head_dim * elem


def capture_calls(calls, n):
    """One CUDA graph of ``n`` calls, rotating over ``calls`` (each run once eagerly first)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    return graph


def time_per_call_us(calls, target_s=0.15):
    """Median GPU time per call of ``calls`` (rotated) replayed from one CUDA graph."""
    n = max(MIN_CALLS_PER_GRAPH, len(calls))
    n = -(-n // len(calls)) * len(calls)
    graph = capture_calls(calls, n)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    reps = max(5, min(60, int(target_s * 1e3 / max(start.elapsed_time(end), 1e-3))))
    per_call = replay_us(graph, reps) / n
    del graph
    return per_call


def replay_us(graph, reps: int) -> float:
    """Median GPU time of one replay of ``graph`` over ``reps`` timed replays, in us."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for e0, e1 in events:
        e0.record()
        graph.replay()
        e1.record()
    torch.cuda.synchronize()
    return statistics.median(e0.elapsed_time(e1) for e0, e1 in events) * 1e3


class Case:
    def __init__(self, shape, batch, seq_len, block_size, device, window=None, int8=False):
        self.shape, self.batch, self.seq_len = shape, batch, seq_len
        num_q, num_kv, dim = shape
        self.bytes = kv_bytes(batch, num_kv, seq_len, dim)
        self.num_sets = max(1, min(64, math.ceil(ROTATE_BYTES / self.bytes)))
        self.dense = []
        for _ in range(self.num_sets):
            q = torch.randn(batch, num_q, dim, device=device, dtype=torch.bfloat16)
            k = torch.randn(batch, num_kv, seq_len, dim, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            self.dense.append((q, k, v))
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        self.workspace = Workspace(batch, num_q, dim, seq_len, device, num_kv_heads=num_kv, windows=(window,))
        self.paged = [(q, *pack_paged(k, v, block_size)) for q, k, v in self.dense]
        self.int8 = [(q, *int8_caches(kc, vc), bt) for q, kc, vc, bt in self.paged] if int8 else []
        # int8 A/B: the same calls planned with twice the splits (the consumers convert codes, so
        # more blocks per SM may pay where the bf16 plan runs one)
        self.workspace_int8 = (Workspace(batch, num_q, dim, seq_len, device, num_kv_heads=num_kv, windows=(window,),
                                         kv_int8=True) if int8 else None)
        self.workspace_2x = (Workspace(batch, num_q, dim, seq_len, device, num_kv_heads=num_kv, windows=(window,),
                                       split_scale=2, kv_int8=True) if int8 else None)

    def ours(self, window=None):
        def make(q, kc, vc, bt):
            return lambda: ops.flash_decode_cuda(q, kc, vc, bt, self.seq_lens, workspace=self.workspace,
                                                 window=window)
        return [make(*s) for s in self.paged]

    def ours_int8(self, window=None, workspace=None):
        workspace = workspace or self.workspace_int8

        def make(q, kc, vc, ks, vs, bt):
            return lambda: ops.flash_decode_cuda(q, kc, vc, bt, self.seq_lens, workspace=workspace,
                                                 window=window, k_scale=ks, v_scale=vs)
        return [make(*s) for s in self.int8]

    def peer(self, backend):
        def make(q, k, v):
            q4 = q.unsqueeze(2)

            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            return call
        return [make(*s) for s in self.dense]


def int8_caches(k_cache, v_cache, blocks_per_pass=4096):
    """The caches' int8 rows: ``(k codes, v codes, k scales, v scales)``, quantised a slice of
    blocks at a time (the float32 copies of a whole large cache would not fit beside it)."""
    out = []
    for cache in (k_cache, v_cache):
        codes = torch.empty(cache.shape, dtype=torch.int8, device=cache.device)
        scales = torch.empty(cache.shape[:3], dtype=torch.float16, device=cache.device)
        for i in range(0, cache.shape[0], blocks_per_pass):
            codes[i:i + blocks_per_pass], scales[i:i + blocks_per_pass] = quantize_rows(cache[i:i + blocks_per_pass])
        out.append((codes, scales))
    (kc, ks), (vc, vs) = out
    return kc, vc, ks, vs


def try_time(calls):
    try:
        return time_per_call_us(calls)
    except (RuntimeError, ValueError) as err:  # a backend refusing this shape
        print(f"    (skipped: {str(err).splitlines()[0][:100]})")
        torch.cuda.synchronize()
        return None


def launch_floor_us(device):
    """GPU time per call of one and of two back-to-back trivial kernels, timed as every case is:
    what a call costs before it moves a byte."""
    x = torch.zeros(1, device=device)
    one = time_per_call_us([lambda: x.add_(1.0)])
    two = time_per_call_us([lambda: (x.add_(1.0), x.mul_(1.0))])
    return {"one_kernel_us": one, "two_kernels_us": two}


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def summarize(rows):
    lines = ["| shape | B | M | KV MB | ours us | cuDNN us | FA us | ours GB/s | % of 4.5 TB/s | ratio to best peer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['batch']} | {r['seq_len']} | {r['kv_mb']:.1f} | {fmt(r['ours_us'])} | "
                     f"{fmt(r['cudnn_us'])} | {fmt(r['flash_us'])} | {fmt(r['ours_gbps'], '.0f')} | "
                     f"{fmt(r['pct_peak'])} | {fmt(r['ratio_best'], '.2f')} |")
    big = [r for r in rows if r["kv_mb"] >= 200]
    mid = [r for r in rows if 3 <= r["kv_mb"] <= 130]
    targets = {
        "min % of 4.5 TB/s, KV >= 200 MB (target >= 90)": min((r["pct_peak"] for r in big), default=None),
        "geomean speedup over cuDNN, KV 3-130 MB (target >= 1.25)":
            geomean([r["cudnn_us"] / r["ours_us"] for r in mid if r["cudnn_us"]]),
        "geomean speedup over best SDPA, all (target >= 1.1)": geomean([r["ratio_best"] for r in rows]),
        "min ratio to best SDPA, all (target >= 0.95)": min((r["ratio_best"] for r in rows if r["ratio_best"]),
                                                           default=None),
    }
    lines.append("")
    lines += [f"{name}: {fmt(value, '.3f')}" for name, value in targets.items()]
    windowed = [r for r in rows if r.get("window")]
    if windowed:
        lines += ["", "| shape | B | M | window | splits | windowed us | unwindowed us | speedup | window KV MB | "
                  "% of 4.5 TB/s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in windowed:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['seq_len']} | {r['window']} | {r['window_splits']} | "
                         f"{fmt(r['window_us'])} | {fmt(r['ours_us'])} | {fmt(r['window_speedup'], '.1f')} | "
                         f"{r['window_kv_mb']:.1f} | {fmt(r['window_pct_peak'])} |")
    return "\n".join(lines), targets


def summarize_int8(rows):
    """Our kernel on int8 caches against ours on bf16 caches and cuDNN on bf16 (issue 49)."""
    lines = ["| shape | B | M | bf16 KV MB | splits | ours bf16 us | ours int8 us | cuDNN bf16 us | int8 / bf16 | "
             "int8 / cuDNN | int8 % of 4.5 TB/s | int8, 2x splits: splits, us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['batch']} | {r['seq_len']} | {r['kv_mb']:.1f} | {r['num_splits']} | "
                     f"{fmt(r['ours_us'])} | {fmt(r['ours_int8_us'])} | {fmt(r['cudnn_us'])} | "
                     f"{fmt(r['int8_speedup'], '.2f')} | {fmt(r['int8_vs_cudnn'], '.2f')} | {fmt(r['int8_pct_peak'])} | "
                     f"{r['int8_2x_splits']}, {fmt(r['ours_int8_2x_us'])} |")
    big = [r["int8_speedup"] for r in rows if r["kv_mb"] >= 200 and r["int8_speedup"]]
    every = [r["int8_speedup"] for r in rows if r["int8_speedup"]]
    targets = {
        "min int8 speedup over our bf16, bf16 KV >= 200 MB (target >= 1.8)": min(big, default=None),
        "min int8 speedup over our bf16, all (target >= 1.0)": min(every, default=None),
        "geomean int8 speedup over our bf16, all": geomean(every),
        "geomean int8 speedup over cuDNN bf16, all": geomean([r["int8_vs_cudnn"] for r in rows if r["int8_vs_cudnn"]]),
    }
    lines.append("")
    lines += [f"{name}: {fmt(value, '.3f')}" for name, value in targets.items()]
    return "\n".join(lines), targets


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        sel = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["kv_mb"])
        for key, label in (("ours_us", "ours (paged split-KV)"), ("cudnn_us", "SDPA cuDNN"), ("flash_us", "SDPA flash")):
            pts = [(r["kv_mb"], r["kv_mb"] * 1e6 / r[key] / 1e3) for r in sel if r[key]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(PEAK_BYTES_PER_S / 1e9, color="gray", linestyle="--", label="4.5 TB/s")
        ax.set_xscale("log")
        ax.set_xlabel("KV size (MB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"decode attention, Hq/Hkv/D = {shape}, bf16")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--quick", action="store_true", help="only the first length of each shape and batch")
    parser.add_argument("--only", nargs="*", default=[], metavar="SHAPE:B:M",
                        help="only these cases, e.g. 9/3/64:64:4096 (the targets are then over these alone)")
    parser.add_argument("--repeat", type=int, default=1, help="time every case this many times (noise)")
    parser.add_argument("--max-kv-mb", type=float, default=MAX_KV_BYTES / 1e6, help="skip cases with more KV")
    parser.add_argument("--shapes", nargs="*", default=None, metavar="HQ/HKV/D", help="only these shapes")
    parser.add_argument("--batches", nargs="*", type=int, default=BATCHES)
    parser.add_argument("--lengths", nargs="*", type=int, default=LENGTHS)
    parser.add_argument("--window", type=int, default=None, help="also time a sliding window of this many tokens")
    parser.add_argument("--int8", action="store_true", help="also time our kernel on int8 caches (a table of its own)")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS), help="SDPA backends timed")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    ops.load(device)
    torch.manual_seed(0)
    rows = []
    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "block_size": args.block_size,
            "min_chunk": constants.MIN_CHUNK, "resident_per_sm": constants.BLOCKS_PER_SM}

    meta.update(launch_floor_us(device))
    print(f"launch floor: one trivial kernel {meta['one_kernel_us']:.2f} us per call, "
          f"two {meta['two_kernels_us']:.2f} us", flush=True)

    def save(targets=None):  # after every case, so a run cut short still leaves its numbers
        (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": targets,
                                                    "sweeps": []}, indent=1))
    shapes = SHAPES if args.shapes is None else [tuple(map(int, s.split("/"))) for s in args.shapes]
    for shape in shapes:
        for batch in args.batches:
            for seq_len in args.lengths[:1] if args.quick else args.lengths:
                nbytes = kv_bytes(batch, shape[1], seq_len, shape[2])
                if nbytes > min(MAX_KV_BYTES, args.max_kv_mb * 1e6):
                    continue
                label = "/".join(map(str, shape))
                if args.only and f"{label}:{batch}:{seq_len}" not in args.only:
                    continue
                window = args.window if args.window and args.window < seq_len else None
                case = Case(shape, batch, seq_len, args.block_size, device, window, int8=args.int8)
                plan = case.workspace.plan(batch)
                row = {"shape": label, "batch": batch, "seq_len": seq_len, "kv_mb": nbytes / 1e6,
                       "num_sets": case.num_sets, "num_splits": plan.num_splits, "three_per_sm": plan.three_per_sm}
                samples = [try_time(case.ours()) for _ in range(args.repeat)]
                samples = [v for v in samples if v is not None]
                row["ours_us"] = statistics.median(samples) if samples else None
                if args.repeat > 1:
                    row["ours_all_us"] = samples
                if args.int8:
                    int8 = [try_time(case.ours_int8()) for _ in range(args.repeat)]
                    int8 = [v for v in int8 if v is not None]
                    row["ours_int8_us"] = statistics.median(int8) if int8 else None
                    row["int8_splits"] = case.workspace_int8.plan(batch).num_splits
                    row["int8_2x_splits"] = case.workspace_2x.plan(batch).num_splits
                    row["ours_int8_2x_us"] = try_time(case.ours_int8(workspace=case.workspace_2x))
                for name, backend in PEERS.items():
                    row[f"{name}_us"] = try_time(case.peer(backend)) if name in args.peers else None
                peers = [row[f"{n}_us"] for n in PEERS if row[f"{n}_us"]]
                ours = row["ours_us"]
                row["ours_gbps"] = nbytes / ours / 1e3 if ours else None
                row["pct_peak"] = 100 * nbytes / (ours * 1e-6) / PEAK_BYTES_PER_S if ours else None
                row["floor_us"] = nbytes / PEAK_BYTES_PER_S * 1e6
                row["ratio_best"] = min(peers) / ours if ours and peers else None
                if args.int8:
                    int8_us = row["ours_int8_us"]
                    int8_bytes = nbytes * (shape[2] + 2) / (2 * shape[2])    # codes and a 2-byte scale per row
                    row["int8_speedup"] = ours / int8_us if ours and int8_us else None
                    row["int8_vs_cudnn"] = row["cudnn_us"] / int8_us if row["cudnn_us"] and int8_us else None
                    row["int8_pct_peak"] = 100 * int8_bytes / (int8_us * 1e-6) / PEAK_BYTES_PER_S if int8_us else None
                print(f"{label} B={batch} M={seq_len}: ours {fmt(ours)} us (S={row['num_splits']}), "
                      f"cuDNN {fmt(row['cudnn_us'])}, FA {fmt(row['flash_us'])}"
                      + (f", ours int8 {fmt(row['ours_int8_us'])} us" if args.int8 else ""), flush=True)
                if window:
                    window_bytes = kv_bytes(batch, shape[1], window, shape[2])
                    row["window"], row["window_kv_mb"] = window, window_bytes / 1e6
                    row["window_splits"] = case.workspace.plan(batch, window).num_splits
                    row["window_us"] = try_time(case.ours(window))
                    w_us = row["window_us"]
                    row["window_speedup"] = ours / w_us if ours and w_us else None
                    row["window_pct_peak"] = 100 * window_bytes / (w_us * 1e-6) / PEAK_BYTES_PER_S if w_us else None
                    if args.int8:
                        row["window_int8_us"] = try_time(case.ours_int8(window))
                    print(f"    window {window}: ours {fmt(w_us)} us (S={row['window_splits']})"
                          + (f", ours int8 {fmt(row['window_int8_us'])} us" if args.int8 else ""), flush=True)
                rows.append(row)
                del case
                torch.cuda.empty_cache()
                save()
    table, targets = summarize(rows)
    if args.int8:
        int8_table, int8_targets = summarize_int8(rows)
        targets.update(int8_targets)
    save(targets)
    plot(rows, out / "bench.png")
    print()
    print(table)
    if args.int8:
        print()
        print(int8_table)


if __name__ == "__main__":
    main()
