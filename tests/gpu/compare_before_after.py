"""Ratios of two trees' kernel and engine benchmarks (written by tests/gpu/before_after.sh).

    python tests/gpu/compare_before_after.py OUT
"""

import json
import math
import statistics
import sys
from pathlib import Path


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def kernel_table(out: Path) -> list[str]:
    runs = {}
    for name in ("before", "after"):
        path = out / f"kernel_{name}" / "bench.json"
        if not path.exists():
            return [f"kernel: {path} missing"]
        runs[name] = {(r["shape"], r["batch"], r["seq_len"]): r for r in json.loads(path.read_text())["rows"]}
    lines = ["| shape | B | M | before us | after us | after / before speed | cuDNN us (after run) |",
             "|---|---|---|---|---|---|---|"]
    speedups = []
    for key, after in runs["after"].items():
        before = runs["before"].get(key)
        if before is None:
            continue
        s = before["ours_us"] / after["ours_us"]
        speedups.append(s)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {before['ours_us']:.1f} | {after['ours_us']:.1f} | "
                     f"{s:.3f}x | {after.get('cudnn_us') or float('nan'):.1f} |")
    lines.append(f"\nkernel: geomean after/before speed {geomean(speedups):.3f}x, "
                 f"slowest cell {min(speedups):.3f}x, fastest {max(speedups):.3f}x over {len(speedups)} cells")
    targets = json.loads((out / "kernel_after" / "bench.json").read_text()).get("targets")
    if targets:
        lines.append(f"after run's targets: {json.dumps(targets)}")
    return lines


def engine_table(out: Path) -> list[str]:
    """One table per model: engine_<model>_<tree>_<round>.json."""
    runs: dict[str, dict[str, list]] = {}
    for path in sorted(out.glob("engine_*_*_*.json")):
        tag, name, _ = path.stem[len("engine_"):].rsplit("_", 2)
        doc = json.loads(path.read_text())
        runs.setdefault(tag, {"before": [], "after": []})[name].append(
            {(r["batch"], r["prompt_len"], r["new_tokens"]): r["ours_tok_per_s"] for r in doc["ours"]})
    if not runs:
        return ["engine: runs missing"]
    lines = []
    for tag, trees in runs.items():
        if not trees["before"] or not trees["after"]:
            lines.append(f"engine, {tag}: runs missing")
            continue
        lines += [f"engine, {tag}:", "",
                  "| B | prompt | new | before tok/s (runs) | after tok/s (runs) | after / before (medians) | spread of before |",
                  "|---|---|---|---|---|---|---|"]
        for key in trees["after"][0]:
            b = [r[key] for r in trees["before"] if key in r]
            a = [r[key] for r in trees["after"] if key in r]
            if not b or not a:
                continue
            spread = (max(b) - min(b)) / statistics.median(b)
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {' / '.join(f'{x:,.0f}' for x in b)} | "
                         f"{' / '.join(f'{x:,.0f}' for x in a)} | {statistics.median(a) / statistics.median(b):.3f}x | "
                         f"{100 * spread:.1f} % |")
        lines.append("")
    return lines


if __name__ == "__main__":
    out = Path(sys.argv[1])
    print("\n".join(kernel_table(out) + [""] + engine_table(out)))
