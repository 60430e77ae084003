"""Projection benchmark: ``python -m kernels.bench_layer_ops [--out DIR]``.

Times our GEMV (``layer_ops.linear`` / ``silu_mul_linear`` for a decode step's few rows)
against cuBLAS through ``F.linear`` (plus ``silu_and_mul`` for the down projection) on the
projections of the two model presets, bf16, the way ``kernels.bench`` times attention: CUDA-graph
replay of calls rotating over enough weight copies to stream past the 60 MB L2 (a decode step
reads each layer's weights from HBM), median per call. Prints a Markdown table; where ours wins
sets ``layer_ops.GEMV_MAX_ROWS`` and ``GEMV_MAX_WEIGHT``.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from . import layer_ops, ops
from .bench import ROTATE_BYTES, time_per_call_us

# (name, n, k, silu_mul): the projections of smollm2-135m and of llama-gqa128
PROJECTIONS = (
    ("smollm2 qkv", 960, 576, False), ("smollm2 o", 576, 576, False), ("smollm2 gate_up", 3072, 576, False),
    ("smollm2 down+silu", 576, 1536, True), ("smollm2 lm_head", 49152, 576, False),
    ("gqa128 qkv", 6144, 4096, False), ("gqa128 gate_up", 28672, 4096, False),
    ("gqa128 down+silu", 4096, 14336, True),
)
ROWS = (1, 2, 4)


def calls_for(n, k, silu_mul, rows, device, ours: bool):
    weight_bytes = n * k * 2
    copies = max(1, min(256, int(ROTATE_BYTES // weight_bytes)))
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(rows, 2 * k if silu_mul else k, device=device, dtype=torch.bfloat16)
    if ours:
        return [lambda w=w: torch.ops.flashdecode.gemv(x, w, silu_mul) for w in weights]
    if silu_mul:
        return [lambda w=w: F.linear(layer_ops.silu_and_mul(x), w) for w in weights]
    return [lambda w=w: F.linear(x, w) for w in weights]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    ops.load(device)
    results = []
    print("| projection | n x k | rows | ours us | cuBLAS us | cuBLAS / ours |\n|---|---|---|---|---|---|")
    for name, n, k, silu_mul in PROJECTIONS:
        for rows in ROWS:
            ours = time_per_call_us(calls_for(n, k, silu_mul, rows, device, ours=True))
            theirs = time_per_call_us(calls_for(n, k, silu_mul, rows, device, ours=False))
            results.append({"projection": name, "n": n, "k": k, "rows": rows, "ours_us": ours, "cublas_us": theirs})
            print(f"| {name} | {n} x {k} | {rows} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f} |", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "layer_ops_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
