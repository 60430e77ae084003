"""The front ends' request pipes to the core: written by the sending thread while there is room,
in order through a writer thread past that, never blocking the sender; read by the core as one
queue that ends when every writer has gone."""

import multiprocessing as mp
import queue
import threading
import time

import pytest

from server.engine.process import RequestInbox, RequestPipe, event_pipe


def writer_threads() -> int:
    return sum(t.name == "request-writer" for t in threading.enumerate())


def message(i: int) -> tuple:
    return ("add", (f"req-{i}", list(range(1000, 1700)), i))      # about 2 KB pickled, as a short prompt


def test_sends_never_wait_for_the_reader_and_arrive_in_order():
    reader, writer = event_pipe(mp.get_context("spawn"))
    pipe = RequestPipe(writer)
    threads_before = writer_threads()
    pipe.send(message(0))
    assert writer_threads() == threads_before           # room in the pipe: written by the sender
    started = time.monotonic()
    for i in range(1, 3000):                             # several times what the pipe holds, nobody reading
        pipe.send(message(i))
    assert time.monotonic() - started < 10
    assert writer_threads() == threads_before + 1        # the rest waits for the writer thread
    inbox = RequestInbox([reader])
    received = [inbox.get(timeout=10) for _ in range(3000)]
    assert [m[1][0] for m in received] == [f"req-{i}" for i in range(3000)]
    assert received[1234] == message(1234)
    with pytest.raises(queue.Empty):
        inbox.get_nowait()
    pipe.send(message(3000))                             # the backlog is empty again
    assert inbox.get(timeout=10) == message(3000)
    pipe.close()
    reader.close()


def test_the_inbox_reads_every_pipe_and_stops_once_all_writers_have_gone():
    ctx = mp.get_context("spawn")
    (reader_a, writer_a), (reader_b, writer_b) = event_pipe(ctx), event_pipe(ctx)
    a, b = RequestPipe(writer_a), RequestPipe(writer_b)
    inbox = RequestInbox([reader_a, reader_b])
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.05)
    a.send(("abort", "0:x"))
    b.send(("abort", "1:y"))
    a.send(("abort", "0:z"))
    got = [inbox.get(timeout=5) for _ in range(3)]
    assert sorted(got) == [("abort", "0:x"), ("abort", "0:z"), ("abort", "1:y")]
    assert got.index(("abort", "0:x")) < got.index(("abort", "0:z"))
    a.close()
    b.send(("abort", "1:w"))
    assert inbox.get(timeout=5) == ("abort", "1:w")      # a gone front end leaves the others served
    b.close()
    assert inbox.get(timeout=5) == ("stop", None)


def test_the_core_stops_reading_at_a_stop_once_its_writers_have_gone():
    """An inbox without writers answers every read with a stop: the core's drain must end there."""
    from server.engine.core import drain_inbox

    reader, writer = event_pipe(mp.get_context("spawn"))
    pipe = RequestPipe(writer)
    inbox = RequestInbox([reader])
    pipe.send(("abort", "x"))
    pipe.close()
    got = []

    def core_loop():                                      # as EngineCore.run reads its inbox
        while ("stop", None) not in got:
            got.extend(drain_inbox(inbox, block=True))
    drainer = threading.Thread(target=core_loop, daemon=True)
    drainer.start()
    drainer.join(timeout=10)
    assert not drainer.is_alive() and got == [("abort", "x"), ("stop", None)]


@pytest.mark.parametrize("backlogged", [False, True])
def test_a_gone_core_takes_nothing_and_the_sender_goes_on(backlogged):
    reader, writer = event_pipe(mp.get_context("spawn"))
    pipe = RequestPipe(writer)
    if backlogged:
        for i in range(3000):                            # the writer thread is blocked on a full pipe
            pipe.send(message(i))
    reader.close()
    deadline = time.monotonic() + 10
    for i in range(50):
        pipe.send(message(i))                            # neither raises nor blocks
    assert time.monotonic() < deadline
    pipe.close()
    pipe.send(message(0))                                # after close: nothing written, nothing raised
