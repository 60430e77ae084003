"""Coalescing of server-sent events: tokens already waiting go out in one write."""

import asyncio

from server.sse import coalesced


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
