"""Parts of the task worker, in this process. Its reader of the loop's frames
(taskworker._Reader): frames come out whole and in order however the stream is cut, a frame
larger than its read buffer is read into a buffer of its own and comes out as a view of it,
and the stream's end is None. Its start of a task: a signal that comes while a start is
being made is noted, and handled once the task has started."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from orchestrator import taskwire as w
from orchestrator import taskworker


def _frames(sizes: list[int]) -> list[tuple[int, int, bytes]]:
    return [(w.TASK, i + 1, os.urandom(size)) for i, size in enumerate(sizes)]


def _read_all(frames: list[tuple[int, int, bytes]], cuts: int | None) -> list[tuple[int, int, bytes | memoryview]]:
    """``frames`` written to a socket in pieces of ``cuts`` bytes (None: at once), read back."""
    stream = b"".join(w.frame(kind, number, payload) for kind, number, payload in frames)
    mine, theirs = socket.socketpair()

    def write() -> None:
        step = cuts or len(stream)
        for at in range(0, len(stream), step):
            theirs.sendall(stream[at:at + step])
        theirs.close()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        reader = taskworker._Reader(mine)
        got = []
        while (one := reader.next()) is not None:
            got.append(one)
        assert reader.next() is None
    finally:
        writer.join(30)
        mine.close()
    return got


@pytest.mark.parametrize("cuts", [None, 1, 7, 4096, 65_536 + 5])
def test_frames_come_out_whole_and_in_order_however_the_stream_is_cut(cuts: int | None) -> None:
    sizes = [0, 40, 100, taskworker._READ - w.HEADER.size, 3, taskworker._READ, 300 << 10, 1, 2 << 20, 9]
    frames = _frames(sizes if cuts is None or cuts > 1 else sizes[:6])  # byte by byte: the smaller ones
    got = _read_all(frames, cuts)
    assert [(kind, number, bytes(payload)) for kind, number, payload in got] == frames
    # A frame over the read buffer comes out as a view of a buffer of its own, not copied.
    assert [isinstance(p, memoryview) for _, _, p in got] == [len(p) + w.HEADER.size > taskworker._READ
                                                             for _, _, p in frames]


def test_a_stream_cut_inside_a_large_frame_ends_the_reading() -> None:
    mine, theirs = socket.socketpair()
    theirs.sendall(w.frame(w.TASK, 1, b"x") + w.header(w.TASK, 2, 1 << 20) + b"y" * 1000)
    theirs.close()
    reader = taskworker._Reader(mine)
    assert reader.next() == (w.TASK, 1, b"x")
    assert reader.next() is None
    mine.close()


def test_a_frame_over_the_wire_limit_is_refused_on_its_header() -> None:
    mine, theirs = socket.socketpair()
    theirs.sendall(w.header(w.TASK, 1, w.MAX_FRAME + 1))
    reader = taskworker._Reader(mine)
    with pytest.raises(ValueError):
        reader.next()
    mine.close()
    theirs.close()


def test_a_cancel_signalled_while_a_task_starts_is_raised_in_it_once_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal comes after the start read the words and before it is made: the handler
    only notes it (it would see a start half made), and the start, once made, handles it:
    Cancelled is raised in the task, which never runs to its result."""
    words = memoryview(bytearray(w.WORD.size * w.WORDS)).cast("Q")
    mine, theirs = socket.socketpair()
    state = {"_word": words, "_sock": mine, "_current": 0, "_slot": 0, "_next": 0, "_skips": 0, "_answered": 0,
             "_ours": None, "_starting": False, "_deferred": False}
    for name, value in state.items():
        monkeypatch.setattr(taskworker, name, value)
    words[1] = w.cancel_word(3, w.CANCEL)  # a stale word of an earlier task: the start looks at the words
    real_look, looks = taskworker._look, []

    def look_then_signal(number: int) -> None:
        looks.append(number)
        real_look(number)
        if len(looks) == 1:  # right after the start's own look: the loop cancels the task and signals
            words[0] = w.cancel_word(number, w.CANCEL)
            taskworker._interrupt(w.CANCEL_SIGNAL, None)
            assert taskworker._deferred, "the handler ran inside a start half made"

    monkeypatch.setattr(taskworker, "_look", look_then_signal)
    try:
        reply = taskworker._run(7, w.dumps((abs, (-1,), {})))
    finally:
        mine.close()
        theirs.close()
    assert reply == w.frame(w.STOPPED, 7, bytes([w.CANCEL]))
    assert looks == [7, 7] and not taskworker._starting and not taskworker._deferred
