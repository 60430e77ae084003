"""Prefill-after-a-cached-prefix benchmark: ``python -m benchmarks.prefill_bench [--out DIR]``.

For each shape (Hq/Hkv/D), batch B, new rows per sequence n and cached tokens per sequence C
(bf16; every sequence of a case alike), times four ways to compute the same attention of the n new
rows over their C + n keys (causal within the new rows):

- ours: ``kernels.flash_prefill`` over the paged cache (split-KV, planned by ``prefill_plan``);
- engine: what ``models.attention.prefill_attention`` runs today, ``kernels.read_kv`` of every key
  row into contiguous K/V, then FlashAttention-2's varlen forward (``aten._flash_attention_forward``);
- FA: the same varlen forward alone on K/V gathered beforehand (the floor of the engine's way);
- cuDNN: SDPA's CUDNN_ATTENTION backend on padded ``[B, H, n | C + n, D]`` tensors (no padding
  here: the sequences of a case are alike) with the bottom-right causal mask as an additive bias,
  the call a fixed-shape caller would make: with ``enable_gqa``, or where cuDNN refuses that, over
  K/V heads repeated beforehand (``cudnn_heads`` in the JSON says which).

GPU time per call under CUDA-graph replay, rotating over enough input sets to stream past the L2,
median over replays (``kernel_bench.time_per_call_us``, the decode benchmark's method). ``--int8``
adds ours and the engine's way on int8 caches of the same values. Prints a Markdown table (speedup
= the peer's time / ours) and writes ``prefill_bench.json`` under ``--out``. ``--write-table PATH``
adds this GPU's measured choices to the engine's table (``kernels.prefill_choice``; the repository's
is ``kernels/prefill_table.json``): the split-KV kernel where its median beats every peer's by more
than ``--margin``.
"""

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels
from kernels import ops, prefill_choice
from kernels.paging import DEFAULT_BLOCK_SIZE, pack_paged
from kernels.workspace import PrefillWorkspace

from .kernel_bench import geomean, int8_caches, try_time

SHAPES = ((9, 3, 64), (32, 8, 128))     # SmolLM2-135M; a 128-dim GQA shape (Llama-3-8B's heads)
BATCHES = (1, 4, 16)
NEW_ROWS = (16, 128, 512)
CACHED = (2048, 8192, 32768)
ROTATE_BYTES = 256e6
MAX_SETS = 32


class Case:
    def __init__(self, shape, batch, new, cached, device, int8=False, block_size=DEFAULT_BLOCK_SIZE):
        num_q, num_kv, dim = shape
        self.shape, self.batch, self.new, self.cached = shape, batch, new, cached
        total = cached + new
        self.kv_bytes = 2 * batch * num_kv * total * dim * 2
        self.num_sets = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / self.kv_bytes)))
        self.scale = dim ** -0.5
        self.cu_q = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device=device)
        self.cu_k = torch.arange(0, (batch + 1) * total, total, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((batch,), total, dtype=torch.int32, device=device)
        self.workspace = PrefillWorkspace(batch * new, num_q, dim, total, device, num_kv_heads=num_kv)
        self.plan = self.workspace.plan(batch * new, batch)
        # bottom-right causal mask of n rows over C + n keys, as an additive bias
        rows = torch.arange(cached, total, device=device).view(-1, 1)
        keys = torch.arange(total, device=device).view(1, -1)
        self.bias = torch.zeros(1, 1, new, total, device=device, dtype=torch.bfloat16).masked_fill(keys > rows,
                                                                                                 float("-inf"))
        self.sets = []
        for _ in range(self.num_sets):
            k = torch.randn(batch, num_kv, total, dim, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(batch * new, num_q, dim, device=device, dtype=torch.bfloat16)
            k_cache, v_cache, table = pack_paged(k, v, block_size)
            positions = torch.arange(total, device=device)
            slots = (table[:, positions // block_size].long() * block_size + positions % block_size).view(-1)
            s = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, table=table, slots=slots.to(torch.int32),
                     k_flat=k.transpose(1, 2).reshape(batch * total, num_kv, dim),
                     v_flat=v.transpose(1, 2).reshape(batch * total, num_kv, dim),
                     q4=q.view(batch, new, num_q, dim).transpose(1, 2))
            if int8:
                s["k8"], s["v8"], s["ks"], s["vs"] = int8_caches(k_cache, v_cache)
            self.sets.append(s)

    def ours(self, int8=False):
        def make(s):
            if int8:
                return lambda: ops.flash_prefill_cuda(s["q"], s["k8"], s["v8"], s["table"], self.cu_q, self.seq_lens,
                                                      scale=self.scale, k_scale=s["ks"], v_scale=s["vs"],
                                                      workspace=self.workspace)
            return lambda: ops.flash_prefill_cuda(s["q"], s["k_cache"], s["v_cache"], s["table"], self.cu_q,
                                                  self.seq_lens, scale=self.scale, workspace=self.workspace)
        return [make(s) for s in self.sets]

    def _flash(self, q, k, v):
        total = self.cached + self.new
        return torch.ops.aten._flash_attention_forward(q, k, v, self.cu_q, self.cu_k, self.new, total, 0.0, True,
                                                       False, scale=self.scale)[0]

    def engine(self, int8=False):
        def make(s):
            def call():
                if int8:
                    k, v = kernels.read_kv(s["k8"], s["v8"], s["slots"], torch.bfloat16, s["ks"], s["vs"])
                else:
                    k, v = kernels.read_kv(s["k_cache"], s["v_cache"], s["slots"], torch.bfloat16)
                return self._flash(s["q"], k, v)
            return call
        return [make(s) for s in self.sets]

    def flash_alone(self):
        return [(lambda s=s: self._flash(s["q"], s["k_flat"], s["v_flat"])) for s in self.sets]

    def cudnn(self, expand_heads=False):
        """cuDNN's SDPA with ``enable_gqa`` or, where it refuses that, over K/V heads repeated
        beforehand (untimed)."""
        group = self.shape[0] // self.shape[1]

        def make(s):
            k, v = s["k"], s["v"]
            if expand_heads:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

            def call():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(s["q4"], k, v, attn_mask=self.bias, scale=self.scale,
                                                          enable_gqa=not expand_heads)
            return call
        return [make(s) for s in self.sets]


def check_agreement(case: Case) -> float:
    """Max difference between ours and the engine's way on the first input set (a sanity check
    that the timed calls compute the same thing; the accuracy tests are tests/gpu/)."""
    ours = case.ours()[0]()
    engine = case.engine()[0]()
    return (ours.float() - engine.float()).abs().max().item()


def run(args):
    device = torch.device("cuda")
    ops.load(device)
    rows = []
    for shape in args.shapes:
        for batch in args.batches:
            for new in args.new_rows:
                for cached in args.cached:
                    case = Case(shape, batch, new, cached, device, int8=args.int8)
                    label = "/".join(map(str, shape))
                    print(f"{label} B={batch} n={new} C={cached}: {case.plan.num_splits} splits, "
                          f"{case.num_sets} input sets", flush=True)
                    r = dict(shape=label, batch=batch, new=new, cached=cached, kv_mb=case.kv_bytes / 1e6,
                             splits=case.plan.num_splits, max_diff_vs_engine=check_agreement(case),
                             ours_us=try_time(case.ours()), engine_us=try_time(case.engine()),
                             flash_us=try_time(case.flash_alone()), cudnn_us=try_time(case.cudnn()),
                             cudnn_heads="gqa")
                    if r["cudnn_us"] is None:
                        r["cudnn_us"], r["cudnn_heads"] = try_time(case.cudnn(expand_heads=True)), "repeated"
                    if args.int8:
                        r["ours_int8_us"] = try_time(case.ours(int8=True))
                        r["engine_int8_us"] = try_time(case.engine(int8=True))
                    rows.append(r)
                    del case
                    torch.cuda.empty_cache()
    return rows


def ratio(peer, ours):
    return peer / ours if peer and ours else None


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def summarize(rows, int8=False):
    head = "| shape | B | n | C | KV MB | splits | ours us | engine us | FA us | cuDNN us | vs engine | vs FA | vs cuDNN |"
    if int8:
        head += " int8 ours us | int8 engine us | int8 vs engine |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['shape']} | {r['batch']} | {r['new']} | {r['cached']} | {r['kv_mb']:.0f} | {r['splits']} | "
                f"{fmt(r['ours_us'])} | {fmt(r['engine_us'])} | {fmt(r['flash_us'])} | {fmt(r['cudnn_us'])} | "
                f"{fmt(ratio(r['engine_us'], r['ours_us']), '.2f')} | {fmt(ratio(r['flash_us'], r['ours_us']), '.2f')} | "
                f"{fmt(ratio(r['cudnn_us'], r['ours_us']), '.2f')} |")
        if int8:
            line += (f" {fmt(r.get('ours_int8_us'))} | {fmt(r.get('engine_int8_us'))} | "
                     f"{fmt(ratio(r.get('engine_int8_us'), r.get('ours_int8_us')), '.2f')} |")
        lines.append(line)
    best_peer = [ratio(min(x for x in (r["flash_us"], r["cudnn_us"]) if x), r["ours_us"]) for r in rows
                 if r["ours_us"] and (r["flash_us"] or r["cudnn_us"])]
    lines += ["",
              f"geomean speedup over the engine's way (read_kv + FA varlen): "
              f"{fmt(geomean([ratio(r['engine_us'], r['ours_us']) for r in rows]), '.3f')}",
              f"geomean speedup over FA varlen alone: {fmt(geomean([ratio(r['flash_us'], r['ours_us']) for r in rows]), '.3f')}",
              f"geomean speedup over cuDNN: {fmt(geomean([ratio(r['cudnn_us'], r['ours_us']) for r in rows]), '.3f')}",
              f"cases where ours beats every peer: {sum(1 for x in best_peer if x and x > 1)} of {len(rows)}",
              f"largest |ours - engine| on a case's first inputs: "
              f"{fmt(max((r['max_diff_vs_engine'] for r in rows), default=None), '.3g')}"]
    return "\n".join(lines)


def parse_shape(text):
    return tuple(int(x) for x in text.split("/"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="folder for prefill_bench.json")
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=list(SHAPES), help="Hq/Hkv/D")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--new-rows", type=int, nargs="+", default=list(NEW_ROWS))
    p.add_argument("--cached", type=int, nargs="+", default=list(CACHED))
    p.add_argument("--int8", action="store_true", help="also ours and the engine's way on int8 caches")
    p.add_argument("--write-table", type=Path, default=None, metavar="PATH",
                   help="add this GPU's per-shape choices to the prefill table at PATH (kernels/prefill_table.json)")
    p.add_argument("--margin", type=float, default=prefill_choice.MARGIN,
                   help="share by which ours must beat the best peer to be chosen")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefill_bench needs a CUDA device")
    rows = run(args)
    device_name = torch.cuda.get_device_name()
    table = summarize(rows, args.int8)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefill_bench.json").write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))
        (args.out / "prefill_bench.md").write_text(f"{device_name}\n\n{table}\n")
    if args.write_table is not None:
        written = prefill_choice.write_table(args.write_table, device_name, rows, args.margin)
        chosen = [e for e in written["devices"][device_name]["entries"] if e["path"] == prefill_choice.SPLIT_KV]
        print(f"prefill table {args.write_table}: {device_name}, the split-KV kernel in {len(chosen)} of "
              f"{len(written['devices'][device_name]['entries'])} cases")
    print(f"\n{device_name}, bf16, GPU time per call under CUDA-graph replay (speedup: the peer's time / ours)\n")
    print(table)


if __name__ == "__main__":
    main()
