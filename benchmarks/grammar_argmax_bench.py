"""Constrained greedy rows: ``python -m benchmarks.grammar_argmax_bench [--out DIR]``.

GPU time per call, under CUDA-graph replay (``kernel_bench.time_per_call_us``), of what gives the
rows a grammar constrains their greedy token once their bitmask is on the device: ours, one
launch of ``kernels.grammar_argmax``, against xgrammar's masking (``apply_token_bitmask_inplace``,
its Triton kernel, idempotent on repeated calls) followed by the argmax of those rows and their
write into the step's ids. Same logits, masks and rows for both (random; a mask allows about
half the vocabulary); the answers are compared before timing. Prints a Markdown table.
"""

import argparse
import json
from pathlib import Path

import torch
import xgrammar as xgr

from kernels.grammar_argmax import grammar_argmax
from server.engine.sampler import argmax_rows

from .kernel_bench import time_per_call_us

CASES = ((64, 1, 49152), (64, 8, 49152), (64, 64, 49152), (1, 1, 49152), (64, 64, 128256), (64, 1, 151936))


def case(batch: int, constrained: int, vocab: int, device):
    logits = torch.randn(batch, vocab, device=device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32, device=device)
    rows = (torch.arange(constrained, dtype=torch.int32, device=device) * (batch // constrained)
            if constrained < batch else None)
    return logits, bitmask, rows


def ours(logits, bitmask, rows, ids, vocab):
    return lambda: grammar_argmax(logits, bitmask, rows, ids, vocab)


def peer(logits, bitmask, rows, ids, vocab):
    def call():
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
        if rows is None:
            ids.copy_(argmax_rows(logits))
        else:
            ids.index_put_((rows.long(),), argmax_rows(logits.index_select(0, rows)).to(torch.int32))
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    results = []
    for batch, constrained, vocab in CASES:
        logits, bitmask, rows = case(batch, constrained, vocab, device)
        ours_ids = torch.zeros(batch, dtype=torch.int32, device=device)
        peer_ids = torch.zeros(batch, dtype=torch.int32, device=device)
        ours_call = ours(logits, bitmask, rows, ours_ids, vocab)
        peer_call = peer(logits.clone(), bitmask, rows, peer_ids, vocab)
        ours_call()
        peer_call()
        assert torch.equal(ours_ids, peer_ids), (batch, constrained, vocab)
        ours_us, peer_us = time_per_call_us([ours_call]), time_per_call_us([peer_call])
        results.append({"batch": batch, "constrained": constrained, "vocab": vocab, "ours_us": round(ours_us, 2),
                        "xgrammar_mask_then_argmax_us": round(peer_us, 2), "speedup": round(peer_us / ours_us, 2)})
    print(f"constrained greedy rows on {name}, GPU time per call under graph replay")
    print("| batch | constrained rows | vocab | ours us | xgrammar mask + argmax us | speedup |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['batch']} | {r['constrained']} | {r['vocab']} | {r['ours_us']} | "
              f"{r['xgrammar_mask_then_argmax_us']} | {r['speedup']} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grammar_argmax_bench.json").write_text(json.dumps({"device": name, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
