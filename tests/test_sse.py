"""Server-sent events: one ``data:`` line per JSON payload; tokens already waiting go out in one
write."""

import asyncio
import json
import math

from hypothesis import given
from hypothesis import strategies as st

from server.sse import coalesced, sse_json

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


def finite(value):
    """``value`` with each non-finite number as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [finite(v) for v in value]
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    return value


def sse_data(event: bytes) -> str:
    """The data of one event, as an EventSource client reads it (WHATWG: lines end at CR, LF or
    CRLF; the data lines' values joined by LF)."""
    text = event.decode("utf-8")
    assert text.endswith("\n\n")
    lines = text[:-2].replace("\r\n", "\n").replace("\r", "\n").split("\n")
    assert all(line.startswith("data: ") for line in lines), lines
    return "\n".join(line.removeprefix("data: ") for line in lines)


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6))
def test_an_event_is_one_data_line_of_the_payloads_json(payload):
    event = sse_json(payload)
    assert event.count(b"\n") == 2 and b"\r" not in event      # one line, then the blank one
    assert json.loads(sse_data(event)) == finite(payload)       # non-finite numbers are null


class FakeGeneration:
    ready = 0

    def has_ready_events(self) -> bool:
        return self.ready > 0


def test_waiting_events_go_out_in_one_write_and_others_at_once():
    gen = FakeGeneration()

    async def chunks():
        for name, still_waiting in ((b"a", 2), (b"b", 1), (b"c", 0), (b"d", 0), (b"e", 1), (b"f", 0)):
            gen.ready = still_waiting
            yield name

    async def main():
        return [c async for c in coalesced(chunks(), gen)]

    assert asyncio.run(main()) == [b"abc", b"d", b"ef"]
