"""`Doorbell` (rlinf_pipe/channels/ready.py): the pipe that wakes a channel end's thread."""

from __future__ import annotations

import os
import resource
import threading

import pytest

from rlinf_pipe.channels.ready import Doorbell


def test_a_ring_ends_a_wait_at_once_and_clearing_rearms_it():
    bell = Doorbell()
    woke = threading.Event()

    def sleeper() -> None:
        bell.wait(60)
        woke.set()

    thread = threading.Thread(target=sleeper)
    thread.start()
    bell.ring()
    bell.ring()  # at most one byte pending: a second ring writes nothing
    assert woke.wait(30)
    thread.join()
    bell.clear()
    assert not bell.rung
    with pytest.raises(BlockingIOError):  # the pipe is empty again
        os.read(bell.rx, 64)
    bell.close()
    bell.close()  # idempotent
    bell.ring()  # harmless once closed
    bell.wait(60)  # returns at once once closed


def test_a_doorbell_works_with_descriptors_numbered_past_1024():
    """Ray, CUDA and NCCL processes often hold more than 1024 descriptors, where `select.select` refuses one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"the descriptor limit is {soft}")
    fillers = []
    try:
        while not fillers or fillers[-1] < 1100:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        bell = Doorbell()
        assert bell.rx > 1024
        bell.ring()
        bell.wait(60)
        bell.clear()
        bell.close()
    finally:
        for fd in fillers:
            os.close(fd)


def test_a_wait_also_ends_when_a_watched_descriptor_becomes_readable_and_follows_a_changed_set():
    """A channel consumer's thread sleeps on its doorbell and its sockets' descriptors together; the set of
    descriptors changes when a producer joins (the doorbell's poller is rebuilt for it, kept otherwise)."""
    bell = Doorbell()
    first, second = os.pipe(), os.pipe()
    try:
        os.write(first[1], b"x")
        bell.wait(60, (first[0],))  # returns at once: the first pipe is readable
        os.read(first[0], 1)
        woke = threading.Event()

        def sleeper() -> None:
            bell.wait(60, (first[0], second[0]))  # a producer joined
            woke.set()

        thread = threading.Thread(target=sleeper)
        thread.start()
        os.write(second[1], b"x")  # readable only in the new set
        assert woke.wait(30)
        thread.join()
    finally:
        bell.close()
        for fd in (*first, *second):
            os.close(fd)
