"""What a load-generator run leaves behind: ``results.json``, ``report.md`` and two PNG plots
(``throughput.png``: throughput and latency percentiles against the load level; ``latency.png``: the
distributions of TTFT, TPOT, ITL and end-to-end latency, one curve per level)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger("loadgen")

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))


def _clean(obj):
    """NaN and infinities become null: the JSON stays strict."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def add_engine_comparison(doc: dict) -> None:
    """Put the offline engine's tokens/s at batch = concurrency beside each concurrency level."""
    engine = doc.get("engine")
    if not engine:
        return
    rows, target = engine["tok_per_s_by_batch"], engine["ratio_target"]
    for lv in doc["levels"]:
        c = lv["level"].get("concurrency")
        s = lv["summary"]
        if c is None or c not in rows:
            s["engine"] = None
            continue
        ratio = s["output_throughput"] / rows[c] if rows[c] > 0 else math.nan
        s["engine"] = {"tok_per_s": rows[c], "ratio": ratio, "target": target,
                       "meets_target": bool(math.isfinite(ratio) and ratio >= target)}


def problems(doc: dict) -> list[str]:
    """What ``--strict`` fails on: failed requests, token counts that disagree, a missed engine ratio."""
    out = []
    for lv in doc["levels"]:
        label, s = lv["level"]["label"], lv["summary"]
        if s["failed"]:
            out.append(f"{label}: {s['failed']} of {s['requests']} requests failed: {s['errors']}")
        check = s["token_check"]
        if check["mismatched"]:
            out.append(f"{label}: {check['mismatched']} requests streamed a different number of tokens than "
                       f"the server reported: {check['examples']}")
        if check["not_requested_length"]:
            out.append(f"{label}: {check['not_requested_length']} requests did not generate the requested "
                       f"number of tokens (ignore_eos not honoured?): {check['examples']}")
        engine = s.get("engine")
        if engine and not engine["meets_target"]:
            out.append(f"{label}: HTTP output {s['output_throughput']:.0f} tok/s is {engine['ratio']:.0%} of the "
                       f"engine's {engine['tok_per_s']:.0f} tok/s, below {engine['target']:.0%}")
    return out


def _f(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:,.{digits}f}"


def markdown(doc: dict) -> str:
    cfg = doc["config"]
    pcts = [f"p{q:g}" for q in cfg["percentiles"]]
    levels = doc["levels"]
    has_engine = any(lv["summary"].get("engine") for lv in levels)
    has_goodput = bool(cfg.get("slos_ms"))
    has_cached = any(lv["summary"].get("cached_prompt_share") is not None for lv in levels)
    level_name = "concurrency" if levels and levels[0]["level"]["mode"] == "concurrency" else "load"

    lines = [f"# Load test: {doc['label']}", ""]
    lines.append(f"- Target: `{cfg['base_url']}{cfg['endpoint']}` ({cfg['backend']}), model "
                 f"`{cfg.get('model') or 'n/a'}`; run started {doc['created']}.")
    eos = "ignore_eos" if cfg["ignore_eos"] else "stopping at EOS"
    sampling = "greedy" if cfg["temperature"] <= 0 else f"temperature {cfg['temperature']:g}"
    lines.append(f"- Prompts: {cfg['input_len']} tokens ({cfg['prompt_lengths']} lengths"
                 + (f", ±{cfg['input_range']:.0%}" if cfg["input_range"] else "")
                 + f"); output: {cfg['output_len']} tokens"
                 + (f" ±{cfg['output_range']:.0%}" if cfg.get("output_range") else "")
                 + f" ({eos}, {sampling}).")
    if cfg.get("shared_prefix"):
        lines.append(f"- Every request starts with the same {cfg['shared_prefix']} tokens, then its own prompt.")
    if cfg.get("multi_turn", 1) > 1:
        lines.append(f"- Multi-turn: conversations of {cfg['multi_turn']} turns; each turn resends the conversation "
                     "so far (questions and answers) plus a new question of the prompt length.")
    if levels and levels[0]["level"]["mode"] == "rate":
        lines.append(f"- Arrivals: gamma, burstiness {cfg['burstiness']:g} (1 = Poisson)"
                     + (f", at most {cfg['max_concurrency']} in flight" if cfg.get("max_concurrency") else "") + ".")
    if has_goodput:
        slo = ", ".join(f"{k.upper()} ≤ {v:g} ms" for k, v in cfg["slos_ms"].items())
        lines.append(f"- Goodput SLOs: {slo}.")
    client = doc["client"]
    library = next((f"{name} {client[name]}" for name in ("aiohttp", "httpx") if name in client), "an unnamed client")
    lines.append(f"- Client: Python {client['python']}, {library}, {client['cpus']} CPUs.")
    lines.append("")

    head = [level_name, "requests ok", "req/s", "output tok/s"]
    if has_engine:
        target = doc["engine"]["ratio_target"]
        head += ["engine tok/s (batch = c)", "HTTP / engine", f"≥ {target:.0%}"]
    head += ["TTFT p50 (ms)", f"TTFT {pcts[-1]} (ms)", "ITL p50 (ms)", f"ITL {pcts[-1]} (ms)"]
    if has_cached:
        head += ["prompt tokens cached"]
    if has_goodput:
        head += ["goodput (req/s)", "SLO met"]
    rows = []
    for lv in levels:
        s = lv["summary"]
        label = str(lv["level"]["concurrency"]) if lv["level"]["mode"] == "concurrency" else lv["level"]["label"]
        row = [label, f"{s['completed']}/{s['requests']}", _f(s["request_throughput"], 2),
               _f(s["output_throughput"])]
        if has_engine:
            e = s.get("engine")
            row += ([_f(e["tok_per_s"]), f"{e['ratio']:.0%}", "yes" if e["meets_target"] else "**no**"]
                    if e else ["–", "–", "–"])
        row += [_f(s["ttft_ms"]["p50"]), _f(s["ttft_ms"][pcts[-1]]), _f(s["itl_ms"]["p50"], 2),
                _f(s["itl_ms"][pcts[-1]], 2)]
        if has_cached:
            share = s.get("cached_prompt_share")
            row += ["–" if share is None else f"{share:.1%}"]
        if has_goodput:
            row += [_f(s["goodput"], 2), f"{s['slo_attainment']:.0%}" if s["slo_attainment"] is not None else "–"]
        rows.append(row)
    lines += _table(head, rows)

    lines += ["", f"Latency in ms, mean / {' / '.join(pcts)}:", ""]
    head = [level_name] + [name for _, name in LATENCIES] + ["duration (s)", "client CPU"]
    rows = []
    for lv in levels:
        s = lv["summary"]
        label = str(lv["level"]["concurrency"]) if lv["level"]["mode"] == "concurrency" else lv["level"]["label"]
        cells = [" / ".join(_f(s[key][k], 2 if key in ("itl_ms", "tpot_ms") else 1) for k in ["mean"] + pcts)
                 for key, _ in LATENCIES]
        rows.append([label, *cells, _f(s["duration_s"]), f"{s['client_cpu_cores']:.0%}"
                     if s.get("client_cpu_cores") is not None else "–"])
    lines += _table(head, rows)

    lines += [""]
    checked = sum(lv["summary"]["token_check"]["checked"] for lv in levels)
    completed = sum(lv["summary"]["completed"] for lv in levels)
    mismatched = sum(lv["summary"]["token_check"]["mismatched"] for lv in levels)
    wrong_len = sum(lv["summary"]["token_check"]["not_requested_length"] for lv in levels)
    exact = all(lv["summary"]["token_check"]["exact"] for lv in levels)
    merged = sum(lv["summary"]["token_check"]["multi_token_chunks"] for lv in levels)
    text = f"Token counts: the server reported its count for {checked} of {completed} completed requests; "
    if exact:
        text += f"{checked - mismatched} of those match the tokens streamed"
    else:
        text += (f"the stream's chunks are a lower bound (a chunk may carry several tokens; --logprobs makes "
                 f"the count exact): {merged} requests had such chunks, {mismatched} streamed more than reported")
    if cfg["ignore_eos"]:
        asked = "the tokens asked" if cfg.get("output_range") else f"{cfg['output_len']} tokens"
        text += f"; {completed - wrong_len} of {completed} generated exactly {asked}"
    lines.append(text + ".")
    for problem in problems(doc):
        lines.append(f"- **{problem}**")
    failed = {k: v for lv in levels for k, v in lv["summary"]["errors"].items()}
    if failed:
        lines += ["", "Errors (first of each kind):", ""] + [f"- `{k}`" for k in list(failed)[:10]]
    return "\n".join(lines) + "\n"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def plot_throughput(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = doc["levels"]
    concurrency = levels[0]["level"]["mode"] == "concurrency"
    labels = [str(lv["level"]["concurrency"]) if concurrency else lv["level"]["label"].split(",")[0][5:]
              for lv in levels]
    x = list(range(len(levels)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    tok = [lv["summary"]["output_throughput"] for lv in levels]
    ax1.plot(x, tok, "o-", label="HTTP streaming, output tok/s")
    engine = [(i, lv["summary"]["engine"]["tok_per_s"]) for i, lv in enumerate(levels) if lv["summary"].get("engine")]
    if engine:
        target = doc["engine"]["ratio_target"]
        ax1.plot([i for i, _ in engine], [v for _, v in engine], "s--", label="offline engine, tok/s")
        ax1.plot([i for i, _ in engine], [v * target for _, v in engine], ":", color="grey",
                 label=f"{target:.0%} of the engine")
    ax1.set_xticks(x, labels)
    ax1.set_xlabel("concurrency" if concurrency else "request rate (req/s)")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("Throughput")
    ax1.grid(alpha=0.3)
    ax1r = ax1.twinx()
    ax1r.plot(x, [lv["summary"]["request_throughput"] for lv in levels], "^--", color="tab:green", alpha=0.6,
              label="requests/s (right axis)")
    ax1r.set_ylabel("requests/s", color="tab:green")
    left, right = ax1.get_legend_handles_labels(), ax1r.get_legend_handles_labels()
    ax1.legend(left[0] + right[0], left[1] + right[1], loc="upper left")

    pct = f"p{doc['config']['percentiles'][-1]:g}"
    for key, name, style in (("ttft_ms", "TTFT", "o-"), ("itl_ms", "ITL", "s-"), ("e2el_ms", "E2EL", "^-")):
        for q, alpha in (("p50", 1.0), (pct, 0.5)):
            ys = [lv["summary"][key][q] for lv in levels]
            ax2.plot(x, [y if y is not None and math.isfinite(y) else float("nan") for y in ys], style,
                     alpha=alpha, label=f"{name} {q}")
    ax2.set_yscale("log")
    ax2.set_xticks(x, labels)
    ax2.set_xlabel("concurrency" if concurrency else "request rate (req/s)")
    ax2.set_ylabel("ms")
    ax2.set_title("Latency percentiles")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(fontsize="small", ncol=3)
    fig.suptitle(doc["label"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(doc: dict, raw: list[list], path: Path) -> None:
    """Empirical CDFs of the four latencies, one curve per level."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    getters = {
        "TTFT": lambda rs: [r.ttft for r in rs if r.ok and r.ttft is not None],
        "TPOT": lambda rs: [r.tpot for r in rs if r.ok and r.tpot is not None and r.output_tokens > 1],
        "ITL": lambda rs: [g for r in rs if r.ok for g in r.itl],
        "E2EL": lambda rs: [r.latency for r in rs if r.ok and r.latency is not None],
    }
    for ax, (name, get) in zip(axes.flat, getters.items()):
        for lv, results in zip(doc["levels"], raw):
            values = sorted(v * 1000.0 for v in get(results) if v > 0)
            if not values:
                continue
            n = len(values)
            ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=lv["level"]["label"])
        lo, hi = ax.get_xlim()
        if lo > 0 and hi / lo > 20:          # log only where the values span decades
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("gaps" if name == "ITL" else "requests"))
        ax.set_title(f"{name} distribution")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(doc["label"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(doc: dict, out_dir: Path, plots: bool = True, raw: list[list] | None = None) -> dict:
    out_dir = Path(out_dir)
    paths: dict = {}
    paths["json"] = out_dir / "results.json"
    paths["json"].write_text(json.dumps(_clean(doc), indent=1, allow_nan=False) + "\n")
    text = markdown(doc)
    paths["markdown"] = out_dir / "report.md"
    plot_files = {"throughput": out_dir / "throughput.png", "latency": out_dir / "latency.png"}
    if plots:
        try:
            plot_throughput(doc, plot_files["throughput"])
            paths["throughput_png"] = plot_files["throughput"]
            if raw is not None:
                plot_latency(doc, raw, plot_files["latency"])
                paths["latency_png"] = plot_files["latency"]
        except ImportError:
            log.warning("matplotlib is not installed: no plots")
    images = [f"![{name}]({p.name})" for name, p in plot_files.items() if p in paths.values()]
    if images:
        text += "\n" + "\n".join(images) + "\n"
    paths["markdown"].write_text(text)
    paths["markdown_text"] = text
    return paths
