"""The engine core in a process of its own: serving, aborts, and what a dead core does to the
server side."""

import asyncio
import os
import time

import pytest

from server.engine import EngineConfig, EngineDeadError, FinishEvent, ProcessEngine, SamplingParams
from server.engine.params import TokenEvent

from .helpers import run_all

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    engine = ProcessEngine("random:tiny", config=EngineConfig(max_batch=4, num_blocks=64, block_size=16))
    engine.start()
    yield engine
    engine.shutdown()


def test_serves_requests_and_aborts_with_the_pool_back_at_idle(engine):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    results = run_all(engine, [([5, 6, 7], params), ([8, 9], params, 2)])
    (tokens, _, done), (_, _, aborted) = results
    assert done.reason == "length" and len(tokens) == 8
    assert aborted.reason == "abort"
    assert engine.stats().kv_blocks_used == 0 and engine.stats().running == 0


@pytest.mark.parametrize("pipe_held_open", [False, True])
def test_a_dead_core_fails_open_streams_and_refuses_new_requests(pipe_held_open):
    engine = ProcessEngine("random:tiny", config=EngineConfig(max_batch=2, num_blocks=128, block_size=16))
    # as if a child of the core kept its end of the pipe: no end of file, only the liveness check
    held = os.dup(engine._writer.fileno()) if pipe_held_open else None
    engine.start()
    try:
        async def main():
            stream = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=1500, ignore_eos=True))
            await stream.__anext__()                  # generating
            engine._process.kill()

            async def rest():
                return [e async for e in stream]
            return (await asyncio.wait_for(rest(), timeout=30))[-1]

        finish = asyncio.run(main())
        assert isinstance(finish, FinishEvent) and finish.reason == "error"
        deadline = time.monotonic() + 10
        while engine.error is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.error and not engine.ready

        async def again():
            engine.add_request([1, 2], SamplingParams(max_new_tokens=2))

        with pytest.raises(EngineDeadError):
            asyncio.run(again())
    finally:
        engine.shutdown()
        if held is not None:
            os.close(held)


def test_the_router_drops_a_gone_worker_and_serves_the_others():
    import multiprocessing as mp

    from server.engine.process import _Router, _unpack, event_pipe

    class GoneWorker:
        sends = 0

        def send(self, message):
            self.sends += 1
            raise BrokenPipeError(32, "Broken pipe")

    gone = GoneWorker()
    reader, writer = event_pipe(mp.get_context("spawn"))
    router = _Router([gone, writer])
    token = lambda rid: (rid, TokenEvent(7, "", None, False, 1.0, False))
    for _ in range(3):
        router([token("0:a"), token("1:b")], "stats")
    router.broadcast(("stopped",))
    assert gone.sends == 1                            # never written to again
    for _ in range(3):
        kind, rows, stats = reader.recv()
        assert kind == "events" and stats == "stats"
        assert [(rid, e.token_id) for rid, e in _unpack(rows)] == [("1:b", 7)]
    assert reader.recv() == ("stopped",) and not reader.poll(0)
    writer.close()
    with pytest.raises(EOFError):                     # the core's end reaches the reader
        reader.recv()
