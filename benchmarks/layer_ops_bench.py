"""Projection benchmark: ``python -m benchmarks.layer_ops_bench [--out DIR]``.

Times a decode step's projections of a few rows as the product runs them through our GEMV
(``torch.ops.flashdecode.gemv`` / ``add_rms_norm_gemv``: the residual add and RMSNorm in front of
the q/k/v and gate/up projections, the gated activation behind gate/up) against what runs
otherwise: cuBLAS through ``F.linear`` with our norm and activation kernels around it. bf16, the
way ``benchmarks.kernel_bench`` times attention: CUDA-graph replay of calls rotating over enough weight
copies to stream past the 60 MB L2 (a decode step reads each layer's weights from HBM), median
per call. Prints a Markdown table; where ours wins sets ``layer_ops.gemv_serves``.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import layer_ops, ops

from .kernel_bench import ROTATE_BYTES, time_per_call_us

# (name, n, k, norm in front, gated epilogue): the projections of five model shapes
PROJECTIONS = (
    ("smollm2-135m qkv", 960, 576, True, False), ("smollm2-135m o", 576, 576, False, False),
    ("smollm2-135m gate_up", 3072, 576, True, True), ("smollm2-135m down", 576, 1536, False, False),
    ("smollm2-135m lm_head", 49152, 576, False, False),
    ("llama3.2-1b qkv", 3072, 2048, True, False), ("2048-wide o", 2048, 2048, False, False),
    ("2048-wide gate_up", 16384, 2048, True, True), ("2048-wide down", 2048, 8192, False, False),
    ("llama3.2-1b lm_head", 128256, 2048, False, False),
    ("smollm2-1.7b qkv", 6144, 2048, True, False), ("smollm2-1.7b lm_head", 49152, 2048, False, False),
    ("4096-wide qkv", 6144, 4096, True, False), ("4096-wide gate_up", 28672, 4096, True, True),
    ("4096-wide down", 4096, 14336, False, False),
)
ROWS = (1, 2, 4)
EPS = 1e-6


def calls_for(n, k, norm, gated, rows, device, ours: bool):
    weight_bytes = n * k * 2
    copies = max(1, min(256, int(ROTATE_BYTES // weight_bytes)))
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm_weight = torch.randn(k, device=device, dtype=torch.bfloat16)
    act = 0 if gated else -1
    if ours and norm:
        return [lambda w=w: torch.ops.flashdecode.add_rms_norm_gemv(x, residual, norm_weight, EPS, w, None, act)
                for w in weights]
    if ours:
        return [lambda w=w: torch.ops.flashdecode.gemv(x, w, None, act) for w in weights]

    def theirs(w):
        h = layer_ops.add_rms_norm(x, residual, norm_weight, EPS)[0] if norm else x
        y = F.linear(h, w)
        return layer_ops.silu_and_mul(y) if gated else y
    return [lambda w=w: theirs(w) for w in weights]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    ops.load(device)
    results = []
    print("| projection | n x k | fused | rows | ours us | cuBLAS + kernels us | theirs / ours | ours GB/s |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, n, k, norm, gated in PROJECTIONS:
        fused = "+".join([*(["norm"] if norm else []), *(["silu"] if gated else [])]) or "-"
        for rows in ROWS:
            if rows * k * 4 > layer_ops.GEMV_MAX_INPUT_BYTES:
                continue
            ours = time_per_call_us(calls_for(n, k, norm, gated, rows, device, ours=True))
            theirs = time_per_call_us(calls_for(n, k, norm, gated, rows, device, ours=False))
            results.append({"projection": name, "n": n, "k": k, "norm": norm, "gated": gated, "rows": rows,
                            "ours_us": ours, "theirs_us": theirs})
            print(f"| {name} | {n} x {k} | {fused} | {rows} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f} | "
                  f"{n * k * 2 / ours / 1e3:.0f} |", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "layer_ops_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
