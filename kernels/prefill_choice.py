"""Which attention a prefill after a cached prefix runs: the split-KV kernel (``flash_prefill``) or
FlashAttention's varlen forward over key rows gathered by ``read_kv``, per shape, from a table
measured on the GPU (``benchmarks.prefill_bench --write-table``).

The table (``prefill_table.json`` beside this file) holds, per GPU name, a grid of measured cases:
a head layout ``Hq/Hkv/D`` and a KV cache dtype, then per batch B, new rows per sequence n and
cached tokens per sequence C the path that won. The split-KV kernel wins a case only where its
median time is below the best peer's by more than the table's margin.

A step is looked up by what the host knows without a sync: its layout and cache dtype (exact
match), its batch, its new rows per sequence (the mean, rounded up) and its longest cached prefix.
Lookup is conservative: the kernel runs only where the step lies inside the measured grid and
every measured case at the corners of the grid cell around it (the nearest measured value below
and above on each axis) chose the kernel. Another GPU, layout or dtype, a value outside the grid's
range or a corner not measured means FlashAttention.
"""

import bisect
import itertools
import json
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("prefill_table.json")
SPLIT_KV = "split_kv"        # kernels.flash_prefill on the paged cache
FLASH = "flash"              # kernels.read_kv, then FlashAttention's varlen forward
MARGIN = 0.03                # the kernel must beat the best peer's median by more than this share
KV_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int8": "int8"}


def kv_dtype_name(dtype) -> str:
    """The table's name of a cache dtype (``torch.bfloat16`` -> ``bf16``; others keep their own
    name, which no measured case carries)."""
    return KV_DTYPES.get(str(dtype), str(dtype))


def layout_name(num_q_heads: int, num_kv_heads: int, head_dim: int) -> str:
    return f"{num_q_heads}/{num_kv_heads}/{head_dim}"


class PrefillChoice:
    """The measured choices of one GPU, head layout and cache dtype: ``{(batch, rows, cached): path}``."""

    def __init__(self, cases: dict[tuple[int, int, int], str] | None = None):
        self.cases = dict(cases or {})
        self.axes = [sorted({key[i] for key in self.cases}) for i in range(3)]

    @property
    def ever_split_kv(self) -> bool:
        """Whether any shape may take the kernel (the engine allocates its workspace only then)."""
        return SPLIT_KV in self.cases.values()

    def path(self, batch: int, rows: int, cached: int) -> str:
        """``SPLIT_KV`` where every measured corner of the cell around (batch, rows, cached) chose it, else ``FLASH``."""
        corners = []
        for axis, value in zip(self.axes, (batch, rows, cached)):
            if not axis or not axis[0] <= value <= axis[-1]:
                return FLASH
            at = bisect.bisect_left(axis, value)
            corners.append({axis[at]} if axis[at] == value else {axis[at - 1], axis[at]})
        if all(self.cases.get(corner) == SPLIT_KV for corner in itertools.product(*corners)):
            return SPLIT_KV
        return FLASH

    def split_kv(self, batch: int, total_rows: int, cached: int) -> bool:
        """Whether a step of ``total_rows`` new rows over ``batch`` sequences, the longest cached
        prefix ``cached`` tokens, runs the kernel."""
        if batch < 1 or total_rows < 1:
            return False
        return self.path(batch, -(-total_rows // batch), cached) == SPLIT_KV


def load_table(path: Path = TABLE_PATH) -> dict:
    """The table file's contents; an absent file is an empty table."""
    path = Path(path)
    if not path.exists():
        return {"devices": {}}
    table = json.loads(path.read_text())
    if not isinstance(table.get("devices"), dict):
        raise ValueError(f"{path}: a prefill table has a 'devices' object, got keys {sorted(table)}")
    return table


def choice_for(device_name: str, num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype,
               path: Path | None = None) -> PrefillChoice:
    """The choices measured on ``device_name`` for this head layout and cache dtype (none: FlashAttention everywhere)."""
    measured = load_table(TABLE_PATH if path is None else path)["devices"].get(device_name, {})
    layout, dtype = layout_name(num_q_heads, num_kv_heads, head_dim), kv_dtype_name(kv_dtype)
    return PrefillChoice({(e["batch"], e["new"], e["cached"]): e["path"] for e in measured.get("entries", ())
                          if e["shape"] == layout and e["kv_dtype"] == dtype})


def winner(ours_us: float | None, peers: dict[str, float | None], margin: float = MARGIN) -> tuple[str, str | None]:
    """(path, best peer's name): ``SPLIT_KV`` only where ours was measured below the best measured
    peer by more than ``margin``; a case without a measured peer keeps FlashAttention."""
    measured = {name: us for name, us in peers.items() if us}
    if not measured:
        return FLASH, None
    best = min(measured, key=measured.get)
    if ours_us and ours_us < measured[best] * (1 - margin):
        return SPLIT_KV, best
    return FLASH, best


def entries_from_results(rows: list[dict], margin: float = MARGIN) -> list[dict]:
    """Table entries from ``benchmarks.prefill_bench``'s result rows: bf16 cases against FA varlen
    alone, the engine's read_kv + FA and cuDNN; int8 cases (where measured) against the engine's
    way on the same int8 caches, the only peer that reads them."""
    entries = []
    for r in rows:
        columns = [("bf16", r.get("ours_us"), {"flash": r.get("flash_us"), "engine": r.get("engine_us"),
                                                "cudnn": r.get("cudnn_us")})]
        if "ours_int8_us" in r:
            columns.append(("int8", r.get("ours_int8_us"), {"engine": r.get("engine_int8_us")}))
        for dtype, ours, peers in columns:
            path, best = winner(ours, peers, margin)
            entries.append(dict(shape=r["shape"], kv_dtype=dtype, batch=r["batch"], new=r["new"], cached=r["cached"],
                                path=path, ours_us=ours, best_peer=best, best_peer_us=peers.get(best)))
    return entries


def write_table(path: Path, device_name: str, rows: list[dict], margin: float = MARGIN) -> dict:
    """Adds ``device_name``'s entries from benchmark rows to the table at ``path`` (a case measured
    again replaces its entry; other cases and other devices stay); returns the new table."""
    table = load_table(path)
    entries = {_case(e): e for e in table["devices"].get(device_name, {}).get("entries", ())}
    entries.update((_case(e), e) for e in entries_from_results(rows, margin))
    table["devices"][device_name] = {"margin": margin, "source": "python -m benchmarks.prefill_bench",
                                     "entries": [entries[key] for key in sorted(entries)]}
    Path(path).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table


def _case(entry: dict) -> tuple:
    return entry["shape"], entry["kv_dtype"], entry["batch"], entry["new"], entry["cached"]
