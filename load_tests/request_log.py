"""Where each request's time to first token went, from the server's request log.

Every "request finished" line of the server's JSON log carries the request's own timings; with
the client's ``X-Request-Start`` (``request_start``, which the load generator sends) they place
each request on one clock:

    sent --way in--> tokenising --tokenize--> admitted --to the engine--> in the engine
         --queue--> scheduled --prefill--> first token in the engine --delivery--> in the API worker

(the API worker and the engine process share the host's monotonic clock only through these
durations, so "to the engine" is what is left of the worker's admission-to-first-token after the
engine's TTFT and the delivery). What lies between the end of tokenising and admission (planning
the request's tokens, the hand-over) is logged in no leg; a record without a delivery time counts
it as 0 (in "to the engine"), and one without the engine's queue (a request the front end ended at
a stop string) is left out. The report: requests per API worker (the number before the ":" of
``engine_request_id``), the median of each leg, how many requests each prefill step served
(requests whose first tokens left the engine less than half a millisecond apart) and the legs by
a request's place in its burst (requests sent less than ``--gap-ms`` apart).

    python -m load_tests.request_log server.log [more logs or .jsonl files]
"""

import argparse
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

LEGS = ("way_in", "tokenize", "to_engine", "queue", "prefill", "delivery", "server_ttft")


@dataclass
class Timeline:
    worker: str
    sent: float                 # the client's X-Request-Start, epoch seconds
    engine_first: float         # the first token leaving the engine, epoch seconds on the server's clock
    way_in: float
    tokenize: float
    to_engine: float
    queue: float
    prefill: float
    delivery: float
    server_ttft: float          # sent to the first token in the API worker


def timeline(record: dict) -> Timeline | None:
    """A request's legs (seconds), or None for a record without the timings they need."""
    try:
        sent, way_in, tokenize = record["request_start"], record["request_to_tokenize_s"], record["tokenize_s"]
        to_first, engine_ttft, queue = record["first_token_s"], record["ttft_s"], record["queue_s"]
    except KeyError:
        return None
    delivery = record.get("first_token_delivery_s") or 0.0
    request_id = record.get("engine_request_id", "")
    server_ttft = way_in + tokenize + to_first
    return Timeline(worker=request_id.split(":", 1)[0] if ":" in request_id else "0", sent=sent,
                    engine_first=sent + server_ttft - delivery, way_in=way_in, tokenize=tokenize,
                    to_engine=to_first - engine_ttft - delivery, queue=queue, prefill=engine_ttft - queue,
                    delivery=delivery, server_ttft=server_ttft)


def read(paths) -> list[Timeline]:
    """The timelines of every finished request in these logs, in the order they were sent."""
    found = []
    for path in paths:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("msg") in (None, "request finished"):
                    t = timeline(record)
                    if t is not None:
                        found.append(t)
    return sorted(found, key=lambda t: t.sent)


def runs(timelines: list[Timeline], gap_s: float, at=lambda t: t.sent) -> list[list[Timeline]]:
    """The timelines in order of ``at``, cut into runs where one comes ``gap_s`` or more after the one before."""
    found: list[list[Timeline]] = []
    for t in sorted(timelines, key=at):
        if found and at(t) - at(found[-1][-1]) < gap_s:
            found[-1].append(t)
        else:
            found.append([t])
    return found


def bursts(timelines: list[Timeline], gap_s: float) -> list[list[Timeline]]:
    """Runs of requests sent less than ``gap_s`` after the one before."""
    return runs(timelines, gap_s)


def prefill_groups(timelines: list[Timeline], gap_s: float = 5e-4) -> Counter:
    """{requests served by one prefill step: how many steps}, a step being a run of requests whose
    first tokens left the engine less than ``gap_s`` after the one before."""
    return Counter(len(step) for step in runs(timelines, gap_s, at=lambda t: t.engine_first))


def median_ms(timelines, leg: str) -> float:
    return 1e3 * statistics.median(getattr(t, leg) for t in timelines)


def report(timelines: list[Timeline], gap_s: float = 3e-3, ranks: int = 16) -> str:
    if not timelines:
        return "no request with request_start (the client's X-Request-Start) and its timings"
    lines = [f"{len(timelines)} requests; per API worker: "
             + ", ".join(f"{w}: {n}" for w, n in sorted(Counter(t.worker for t in timelines).items())),
             "", "| | " + " | ".join(LEGS) + " |", "|---|" + "---:|" * len(LEGS),
             "| median, ms | " + " | ".join(f"{median_ms(timelines, leg):.2f}" for leg in LEGS) + " |"]
    by_worker = defaultdict(list)
    for t in timelines:
        by_worker[t.worker].append(t)
    for worker, mine in sorted(by_worker.items()):
        lines.append(f"| worker {worker} ({len(mine)}) | " + " | ".join(f"{median_ms(mine, leg):.2f}" for leg in LEGS)
                     + " |")
    groups = prefill_groups(timelines)
    sent_together = bursts(timelines, gap_s)
    lines += ["", "requests a prefill step served: " + ", ".join(f"{n}: {c} steps" for n, c in sorted(groups.items())),
              "burst sizes: " + ", ".join(f"{n}: {c}" for n, c in sorted(Counter(map(len, sent_together)).items()))]
    by_rank = defaultdict(list)
    offsets = defaultdict(list)
    for run in sent_together:
        for rank, t in enumerate(run[:ranks]):
            by_rank[rank].append(t)
            offsets[rank].append(t.sent - run[0].sent)
    lines += ["", f"By place in a burst (requests sent less than {gap_s * 1e3:g} ms apart), medians in ms:", "",
              "| place | requests | sent after the first | " + " | ".join(LEGS) + " |",
              "|---:|---:|---:|" + "---:|" * len(LEGS)]
    for rank in sorted(by_rank):
        mine = by_rank[rank]
        lines.append(f"| {rank} | {len(mine)} | {1e3 * statistics.median(offsets[rank]):.2f} | "
                     + " | ".join(f"{median_ms(mine, leg):.2f}" for leg in LEGS) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", help="server logs (JSON lines) or the request lines taken from them")
    ap.add_argument("--gap-ms", type=float, default=3.0, help="requests sent closer than this form a burst")
    args = ap.parse_args(argv)
    print(report(read(args.logs), args.gap_ms / 1e3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
