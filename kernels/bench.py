"""Kernel benchmark: ``python -m kernels.bench [--out DIR] [--sweep]``.

For each shape (Hq/Hkv/D), batch and length of the grid (bf16), times our paged flash decode
and PyTorch SDPA's cuDNN and flash backends on contiguous ``[B, Hkv, M, D]`` KV with
``enable_gqa=True``. Every implementation is timed the same way: CUDA-graph replay of at least
20 calls that rotate over enough input sets to stream well past the 60 MB L2, median over
replays, per call. Writes ``bench.json`` and ``bench.png`` under ``--out`` and prints a Markdown
table plus the geometric means the targets name. ``--sweep`` also times other split counts,
the merge modes and other block sizes (tuning data, in the JSON and a short table); ``--modes``
times ours in other merge modes beside the default for every case (``--spread-modes`` the same
with one block per SM where the grid fits; ``--ring-stages`` other ring depths; ``--cluster-sweep``
the cluster merge at 2-16 splits; ``--variant`` any other launch arguments of ours, or the block
size and table order); ``--repeat`` times each of them several times, interleaved; ``--only``
and ``--max-kv-mb`` leave out cases. It also times the launch floor: one and two trivial
kernels per call, replayed the same way.
"""

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import ops, planner
from .paging import DEFAULT_BLOCK_SIZE, pack_paged
from .workspace import Workspace

SHAPES = ((9, 3, 64), (32, 8, 128))
BATCHES = (1, 8, 64)
LENGTHS = (512, 4096, 32768, 131072)
PEAK_BYTES_PER_S = 4.5e12
MAX_KV_BYTES = 20e9
ROTATE_BYTES = 256e6
MIN_CALLS_PER_GRAPH = 20
PEERS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
SWEEP_BLOCK_SIZES = (16, 32, 64, 128)
SWEEP_BLOCK_CASES = {((9, 3, 64), 1, 32768), ((9, 3, 64), 64, 4096), ((32, 8, 128), 1, 4096),
                     ((32, 8, 128), 8, 32768)}


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
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for e0, e1 in events:
        e0.record()
        graph.replay()
        e1.record()
    torch.cuda.synchronize()
    per_call = statistics.median(e0.elapsed_time(e1) for e0, e1 in events) * 1e3 / n
    del graph
    return per_call


class Case:
    def __init__(self, shape, batch, seq_len, block_size, device):
        self.shape, self.batch, self.seq_len = shape, batch, seq_len
        num_q, num_kv, dim = shape
        self.bytes = kv_bytes(batch, num_kv, seq_len, dim)
        self.num_sets = max(1, min(64, math.ceil(ROTATE_BYTES / self.bytes)))
        self.dense, self.paged = [], {}
        for _ in range(self.num_sets):
            q = torch.randn(batch, num_q, dim, device=device, dtype=torch.bfloat16)
            k = torch.randn(batch, num_kv, seq_len, dim, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            self.dense.append((q, k, v))
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        self.workspace = Workspace(batch, num_q, dim, seq_len, device, num_kv_heads=num_kv)
        self.block_size = block_size
        self.paged[block_size, True] = self._pack(block_size)

    def _pack(self, block_size, shuffle=True):
        return [(q, *pack_paged(k, v, block_size, shuffle=shuffle)) for q, k, v in self.dense]

    def paged_sets(self, block_size, shuffle=True):
        if (block_size, shuffle) not in self.paged:
            self.paged[block_size, shuffle] = self._pack(block_size, shuffle)
        return self.paged[block_size, shuffle]

    def ours(self, block_size=None, num_splits=None, merge_mode=None, buffers=None, min_chunk=None, spread=False,
             ring_stages=0, copy_rows=0, read_ahead=True, warp_tokens=0, merge_one_trip=True, ahead_tiles=0,
             shuffle=True):
        ws = self.workspace if buffers is None else buffers

        def make(q, kc, vc, bt):
            if buffers is None:
                return lambda: ops.flash_decode_cuda(q, kc, vc, bt, self.seq_lens, workspace=ws,
                                                     num_splits=num_splits, merge_mode=merge_mode, spread=spread,
                                                     ring_stages=ring_stages, copy_rows=copy_rows,
                                                     read_ahead=read_ahead, warp_tokens=warp_tokens,
                                                     merge_one_trip=merge_one_trip, ahead_tiles=ahead_tiles)
            return lambda: torch.ops.flashdecode.flash_decode(
                q, kc, vc, bt, self.seq_lens, q.shape[-1] ** -0.5, num_splits, ws.partial_out, ws.partial_lse,
                ws.merge_counters, ops.DEFAULT_MERGE if merge_mode is None else merge_mode,
                planner.MIN_CHUNK if min_chunk is None else min_chunk, spread, ring_stages, copy_rows, read_ahead,
                warp_tokens, bool(merge_one_trip), int(ahead_tiles))
        return [make(*s) for s in self.paged_sets(block_size or self.block_size, shuffle)]

    def peer(self, backend):
        def make(q, k, v):
            q4 = q.unsqueeze(2)

            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            return call
        return [make(*s) for s in self.dense]


class SweepBuffers:
    """Workspace-shaped buffers with room for any split count up to ops.MAX_SPLITS."""

    def __init__(self, batch, num_q_heads, head_dim, device):
        rows = batch * ops.MAX_SPLITS
        self.partial_out = torch.empty(rows, num_q_heads, head_dim, dtype=torch.float32, device=device)
        self.partial_lse = torch.empty(rows, num_q_heads, dtype=torch.float32, device=device)
        self.merge_counters = torch.zeros(batch * num_q_heads, dtype=torch.int32, device=device)


def try_time(calls):
    try:
        return time_per_call_us(calls)
    except (RuntimeError, ValueError) as err:  # a backend, or launch arguments of ours, refusing this shape
        print(f"    (skipped: {str(err).splitlines()[0][:100]})")
        torch.cuda.synchronize()
        return None


def sweep_case(case, device):
    num_q, num_kv, dim = case.shape
    planned = case.workspace.num_splits(case.batch)
    buffers = SweepBuffers(case.batch, num_q, dim, device)
    cap = min(ops.MAX_SPLITS, planner.max_splits_for(case.seq_len, ops.MAX_SPLITS))
    candidates = sorted({max(1, planned // 2), planned, min(cap, planned * 3 // 2), min(cap, 2 * planned),
                         min(cap, 3 * planned), min(cap, 2), min(cap, 4)})
    result = {"planned_splits": planned, "splits_us": {}, "merge_us": {}, "block_size_us": {}, "min_chunk_us": {}}
    for splits in candidates:
        result["splits_us"][splits] = try_time(case.ours(num_splits=splits, buffers=buffers))
    if planned > 1:
        for mode in ops.MERGE_MODES:
            result["merge_us"][mode] = try_time(case.ours(num_splits=planned, merge_mode=mode, buffers=buffers))
        for chunk in (64, 128, 512):
            result["min_chunk_us"][chunk] = try_time(case.ours(num_splits=planned, min_chunk=chunk, buffers=buffers))
    if (case.shape, case.batch, case.seq_len) in SWEEP_BLOCK_CASES:
        for bs in SWEEP_BLOCK_SIZES:
            result["block_size_us"][bs] = try_time(case.ours(block_size=bs))
    return result


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
    parser.add_argument("--sweep", action="store_true", help="also time split counts, merge modes, block sizes")
    parser.add_argument("--quick", action="store_true", help="only the first length of each shape and batch")
    parser.add_argument("--only", nargs="*", default=[], metavar="SHAPE:B:M",
                        help="only these cases, e.g. 9/3/64:64:4096 (the targets are then over these alone)")
    parser.add_argument("--modes", type=int, nargs="*", default=[],
                        help="merge modes (kernels.ops.MERGE_*) to time beside the default for every case")
    parser.add_argument("--spread-modes", type=int, nargs="*", default=[],
                        help="merge modes to time with spread=True (one block per SM where the grid fits)")
    parser.add_argument("--ring-stages", type=int, nargs="*", default=[],
                        help="ring depths (K/V tiles in flight per block) to time beside the launcher's choice")
    parser.add_argument("--cluster-sweep", action="store_true",
                        help="also time the cluster merge (mode 6, spread) at 2, 4, 8 and 16 splits")
    parser.add_argument("--variant", nargs="*", default=[], metavar="ARG=N[,ARG=N]",
                        help="arguments of Case.ours to time beside the default, each variant its arguments "
                             "together (integers): e.g. block_size=128, copy_rows=16, read_ahead=0, shuffle=0 "
                             "(a block table of consecutive blocks), warp_tokens=16,ring_stages=2")
    parser.add_argument("--repeat", type=int, default=1, help="time every case this many times (noise)")
    parser.add_argument("--max-kv-mb", type=float, default=MAX_KV_BYTES / 1e6, help="skip cases with more KV")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    ops.load(device)
    torch.manual_seed(0)
    rows, sweeps = [], []
    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "block_size": args.block_size,
            "min_chunk": planner.MIN_CHUNK, "resident_per_sm": planner.RESIDENT_PER_SM, "default_merge": ops.DEFAULT_MERGE}

    variants = [(f"ours_mode{m}_us", f"mode {m}", {"merge_mode": m}) for m in args.modes]
    variants += [(f"ours_mode{m}_spread_us", f"mode {m} spread", {"merge_mode": m, "spread": True})
                 for m in args.spread_modes]
    variants += [(f"ours_ring{n}_us", f"ring {n}", {"ring_stages": n}) for n in args.ring_stages]
    for spec in args.variant:
        kwargs = {k: int(v) for k, v in (item.split("=") for item in spec.split(","))}
        variants.append((f"ours_{spec.replace('=', '').replace(',', '_')}_us", spec, kwargs))
    meta.update(launch_floor_us(device))
    print(f"launch floor: one trivial kernel {meta['one_kernel_us']:.2f} us per call, "
          f"two {meta['two_kernels_us']:.2f} us", flush=True)

    def save(targets=None):  # after every case, so a run cut short still leaves its numbers
        (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": targets,
                                                    "sweeps": sweeps}, indent=1))
    for shape in SHAPES:
        for batch in BATCHES:
            for seq_len in LENGTHS[:1] if args.quick else LENGTHS:
                nbytes = kv_bytes(batch, shape[1], seq_len, shape[2])
                if nbytes > min(MAX_KV_BYTES, args.max_kv_mb * 1e6):
                    continue
                label = "/".join(map(str, shape))
                if args.only and f"{label}:{batch}:{seq_len}" not in args.only:
                    continue
                case = Case(shape, batch, seq_len, args.block_size, device)
                row = {"shape": label, "batch": batch, "seq_len": seq_len, "kv_mb": nbytes / 1e6,
                       "num_sets": case.num_sets, "num_splits": case.workspace.num_splits(batch)}
                timed = [("ours_us", {})] + [(key, kwargs) for key, _, kwargs in variants]
                samples = {key: [] for key, _ in timed}
                buffers = SweepBuffers(batch, shape[0], shape[2], device) if any(
                    "num_splits" in kwargs for _, kwargs in timed) else None
                for _ in range(args.repeat):  # interleaved, so that drift on the host spreads evenly
                    for key, kwargs in timed:
                        extra = {"buffers": buffers} if "num_splits" in kwargs else {}
                        samples[key].append(try_time(case.ours(**kwargs, **extra)))
                for key, values in samples.items():
                    values = [v for v in values if v is not None]
                    row[key] = statistics.median(values) if values else None
                    if args.repeat > 1:
                        row[key.replace("_us", "_all_us")] = values
                if args.cluster_sweep:
                    buffers = buffers or SweepBuffers(batch, shape[0], shape[2], device)
                    cap = planner.max_splits_for(seq_len, ops.MAX_SPLITS)
                    row["cluster_sweep_us"] = {
                        n: try_time(case.ours(num_splits=n, merge_mode=ops.MERGE_CLUSTER_PDL, spread=True,
                                              buffers=buffers))
                        for n in (2, 4, 8, 16) if n <= cap}
                for name, backend in PEERS.items():
                    row[f"{name}_us"] = try_time(case.peer(backend))
                peers = [row[f"{n}_us"] for n in PEERS if row[f"{n}_us"]]
                ours = row["ours_us"]
                row["ours_gbps"] = nbytes / ours / 1e3 if ours else None
                row["pct_peak"] = 100 * nbytes / (ours * 1e-6) / PEAK_BYTES_PER_S if ours else None
                row["floor_us"] = nbytes / PEAK_BYTES_PER_S * 1e6
                row["ratio_best"] = min(peers) / ours if ours and peers else None
                modes = "".join(f", {name} {fmt(row[key])}" for key, name, _ in variants)
                if args.cluster_sweep:
                    modes += f", cluster sweep {{{', '.join(f'{n}: {fmt(t)}' for n, t in row['cluster_sweep_us'].items())}}}"
                print(f"{label} B={batch} M={seq_len}: ours {fmt(ours)} us (S={row['num_splits']}){modes}, "
                      f"cuDNN {fmt(row['cudnn_us'])}, FA {fmt(row['flash_us'])}", flush=True)
                if args.sweep:
                    sweep = sweep_case(case, device)
                    sweep.update(shape=label, batch=batch, seq_len=seq_len, kv_mb=row["kv_mb"])
                    sweeps.append(sweep)
                    short = {k: {n: round(t, 1) for n, t in v.items() if t} for k, v in sweep.items()
                             if k.endswith("_us")}
                    print(f"    S={sweep['planned_splits']} {short}", flush=True)
                rows.append(row)
                del case
                torch.cuda.empty_cache()
                save()
    table, targets = summarize(rows)
    save(targets)
    plot(rows, out / "bench.png")
    print()
    print(table)
    for key, name, _ in variants:
        speedups = [r["ours_us"] / r[key] for r in rows if r[key] and r["ours_us"]]
        print(f"{name} against the default: geomean speedup "
              f"{fmt(geomean(speedups), '.3f')}, range {fmt(min(speedups, default=None), '.3f')}-"
              f"{fmt(max(speedups, default=None), '.3f')}")
        for r in rows:
            r[key.replace("_us", "_speedup")] = r["ours_us"] / r[key] if r[key] and r["ours_us"] else None
    save(targets)


if __name__ == "__main__":
    main()
