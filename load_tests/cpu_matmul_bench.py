"""The CPU path's projections alone: our int4 matmuls on the GGUF's own weights (as the engine
holds them: one layer's fused q/k/v, o, fused gate/up and down, and the LM head) against dense
float32 and bfloat16 matmuls of the same shapes, at the rows of a decode step (1) and of prefills.
It shows what PyTorch's int4 kernel gives on this CPU: its fast path is AVX-512's (docs/cpu.md,
Hosts without AVX-512). Medians of 7 timings of ``--calls`` calls each; GB/s counts the weights' bytes.

    python -m load_tests.cpu_matmul_bench --rows 1 16 128 --threads 1 2
"""

import argparse
import statistics
import timeit

import torch
import torch.nn.functional as F

from models import cpu_forward, load_model


def median_us(fn, calls: int) -> float:
    fn()                                                         # warm-up
    return statistics.median(timeit.repeat(fn, repeat=7, number=calls)) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a GGUF model (default: the embedded SmolLM2)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()

    loaded = load_model(args.model, device="cpu")
    step = cpu_forward(loaded.model, loaded.gguf_path, "quantized", 256)
    _, qkv, o, _, gate_up, down = step.layers[0]
    linears = {"qkv": qkv, "o": o, "gate_up": gate_up, "down": down, "head": step.head}
    print(f"{loaded.name}, torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| threads | rows | matrix | out x in | int4 us (GB/s) | float32 us | bfloat16 us | float32 us / int4 us |")
    print("|---:|---:|---|---|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            for name, linear in linears.items():
                n, k = linear.out_features, linear.in_features
                dense = torch.randn(n, k)
                x = torch.randn(rows, k)
                xb, dense_b = x.bfloat16(), dense.bfloat16()
                int4 = median_us(lambda: linear(xb), args.calls)
                f32 = median_us(lambda: F.linear(x, dense), args.calls)
                bf16 = median_us(lambda: F.linear(xb, dense_b), args.calls)
                print(f"| {threads} | {rows} | {name} | {n} x {k} | {int4:.0f} ({linear.nbytes / int4 / 1e3:.1f}) "
                      f"| {f32:.0f} | {bf16:.0f} | {f32 / int4:.2f}x |")


if __name__ == "__main__":
    main()
