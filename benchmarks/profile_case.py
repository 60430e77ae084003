"""One benchmark case, called eagerly, for an external profiler:
``ncu --kernel-name regex:split_kernel python -m benchmarks.profile_case --shape 9/3/64 --batch 8 --seq-len 4096``.

The inputs are kernel_bench.py's (paged cache, the default block size, shuffled block table, enough input sets
to stream past the L2); ``--calls`` calls rotate over them, so a profiler that skips the first
few launches sees a call with a cold L2, as the benchmark does.
"""

import argparse

import torch

from kernels import ops
from kernels.paging import DEFAULT_BLOCK_SIZE

from . import kernel_bench as bench


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="9/3/64", help="Hq/Hkv/D")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--peer", choices=sorted(bench.PEERS), help="call this SDPA backend instead of ours")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    ops.load(device)
    shape = tuple(int(x) for x in args.shape.split("/"))
    case = bench.Case(shape, args.batch, args.seq_len, DEFAULT_BLOCK_SIZE, device)
    calls = case.peer(bench.PEERS[args.peer]) if args.peer else case.ours()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # a profiler run with --profile-from-start off sees these calls alone
    for i in range(args.calls):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    who = args.peer or f"ours, {case.workspace.num_splits(args.batch)} splits"
    print(f"{args.shape} B={args.batch} M={args.seq_len}: {args.calls} calls ({who})")


if __name__ == "__main__":
    main()
