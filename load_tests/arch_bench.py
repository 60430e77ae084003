"""Decode throughput per architecture preset: our fused decoder, transformers' modules with our
attention (the engine with ``fused_layers=False``), and transformers' ``generate`` with a static
cache, side by side in one process on the same weights and random prompts.

    python -m load_tests.arch_bench --device cuda --out results/arch      # every preset, B = 1 and 64
    python -m load_tests.arch_bench --device cpu --presets qwen3-0.6b@1 --batch 1 --prompt-len 8 \
        --new-tokens 4 --repeats 1                                          # a smoke run

Tokens/s counts generated tokens over the wall time of the whole batch (prefill included, as
``engine_bench``), medians over ``--repeats`` interleaved rounds. Each preset's row is written to
``<out>/arch_bench.json`` as soon as it is measured, so a run cut short keeps what it finished.
"""

import argparse
import copy
import gc
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from models import FusedDecoder, load_model
from models.presets import ARCHITECTURES
from server.engine import EngineConfig, EngineCore

from .engine_bench import interleaved, random_prompts, run_hf, run_ours

COLUMNS = ("fused", "modules", "hf_static")


def engine_config(max_batch: int, longest: int, block_size: int, fused: bool) -> EngineConfig:
    blocks_per_seq = -(-longest // block_size) + 1
    buckets = tuple(sorted({1, max_batch}))
    return EngineConfig(max_batch=max_batch, max_model_len=max(longest, 1024), max_prefill_tokens=max(8192, longest),
                        num_blocks=max_batch * blocks_per_seq, block_size=block_size, graph_buckets=buckets,
                        prefill_graph_buckets=(), fused_layers=fused, prefix_caching=False)


def bench_preset(spec: str, args) -> list[dict]:
    started = time.perf_counter()
    loaded = load_model(f"random:{spec}", dtype=args.dtype, device=args.device)
    vocab = min(loaded.config.vocab_size, 49152)          # ids the presets' tokenizer can print
    longest = args.prompt_len + args.new_tokens
    max_batch = max(args.batch)
    cores = {name: EngineCore(loaded, engine_config(max_batch, longest, args.block_size, fused=name == "fused"),
                              publish=lambda pairs, stats: None)
             for name in ("fused", "modules")}
    step = cores["fused"].runner.forward
    if loaded.device.type == "cuda" and not isinstance(step, FusedDecoder):
        raise RuntimeError(f"{spec}: the fused engine runs {step}, not the fused decoder")
    hf_model = copy.deepcopy(loaded.model)
    hf_model.set_attn_implementation("sdpa")
    setup_s = time.perf_counter() - started
    rows = []
    for batch in args.batch:
        def prompts_of(round_, batch=batch):
            return random_prompts(batch, args.prompt_len, vocab, seed=batch * 1000 + round_ + 1)

        runners = {name: lambda r, core=core: run_ours(core, prompts_of(r), args.new_tokens)
                   for name, core in cores.items()}
        runners["hf_static"] = lambda r: run_hf(hf_model, prompts_of(r), args.new_tokens, "static")
        warm = time.perf_counter()
        for core in cores.values():
            run_ours(core, prompts_of(-1)[:1], 4)
        run_hf(hf_model, prompts_of(-1), args.new_tokens, "static")     # compiles at the full length
        warm_s = time.perf_counter() - warm
        samples = interleaved(runners, args.repeats)
        rates = {name: batch * args.new_tokens / statistics.median(v) for name, v in samples.items()}
        row = {"preset": spec, "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "fused_step": type(step).__name__, "setup_s": setup_s, "warmup_s": warm_s, "runs_s": samples,
               **{f"{name}_tok_per_s": rates.get(name) for name in COLUMNS}}
        hf = rates.get("hf_static")
        row["fused_over_hf_static"] = rates["fused"] / hf if hf else None
        row["fused_over_modules"] = rates["fused"] / rates["modules"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs_s"}), flush=True)
    del cores, hf_model, loaded, step
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def markdown(rows) -> str:
    head = ["preset", "B", "fused tok/s", "transformers modules + our attention", "HF generate static",
            "fused / HF static", "fused / modules"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for r in rows:
        lines.append("| " + " | ".join([r["preset"], str(r["batch"]), fmt(r["fused_tok_per_s"], ".0f"),
                                        fmt(r["modules_tok_per_s"], ".0f"), fmt(r["hf_static_tok_per_s"], ".0f"),
                                        fmt(r["fused_over_hf_static"], ".2f") + "x",
                                        fmt(r["fused_over_modules"], ".2f") + "x"]) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=list(ARCHITECTURES), help="random presets (name or name@layers)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rows, failed = [], {}
    for spec in args.presets:
        try:
            rows += bench_preset(spec, args)
        except Exception as e:          # one preset's failure must not lose the others' rows
            logging.exception("%s failed", spec)
            failed[spec] = f"{type(e).__name__}: {e}"
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
            (args.out / "arch_bench.json").write_text(json.dumps({"gpu": gpu, "rows": rows, "failed": failed},
                                                                 indent=2))
    table = markdown(rows)
    if args.out:
        (args.out / "arch_bench.md").write_text(table + "\n")
    print(table)
    for spec, error in failed.items():
        print(f"FAILED {spec}: {error}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
