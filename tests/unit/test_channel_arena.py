"""The channel's shared-memory arena in one process: allocation, copies in, leased views, release."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from rlinf_pipe.channels.arena import (
    ALIGN,
    Allocator,
    ArenaRecord,
    ArenaView,
    SharedArena,
    process_start,
    this_process,
)


def write(arena: SharedArena, buffer: np.ndarray) -> int | None:
    """Copy one large buffer in: its region's offset, or None for want of room."""
    _, _, regions, _ = arena.place([buffer])
    return regions[0] if regions else None


def test_allocation_is_first_fit_aligned_and_frees_merge_with_both_neighbours():
    allocator = Allocator(10 * ALIGN)
    a, b, c = allocator.alloc(1), allocator.alloc(ALIGN + 1), allocator.alloc(3 * ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)  # rounded up to whole cache lines, lowest first
    assert allocator.used_bytes == 6 * ALIGN
    assert allocator.alloc(5 * ALIGN) is None  # 4 lines left
    assert allocator.free(b) and not allocator.free(b) and not allocator.free(7)  # unknown offsets change nothing
    assert allocator.alloc(ALIGN) == ALIGN  # the lowest hole first
    assert allocator.free(ALIGN) and allocator.free(a) and allocator.free(c)
    assert allocator.used_bytes == 0
    assert allocator.alloc(10 * ALIGN) == 0  # the holes merged back into one region


def test_random_alloc_and_free_never_overlap_and_return_every_byte():
    rng = np.random.default_rng(0)
    allocator = Allocator(4096 * ALIGN)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            offset = int(rng.choice(list(live)))
            assert allocator.free(offset)
            del live[offset]
        else:
            nbytes = int(rng.integers(1, 64 * ALIGN))
            offset = allocator.alloc(nbytes)
            if offset is not None:
                live[offset] = -(-nbytes // ALIGN) * ALIGN
        spans = sorted(live.items())
        assert all(o1 + n1 <= o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))
        assert allocator.used_bytes == sum(live.values())
    for offset in list(live):
        allocator.free(offset)
    assert allocator.alloc(4096 * ALIGN) == 0


def test_a_lease_views_the_producers_bytes_and_is_released_when_its_last_view_goes():
    arena = SharedArena.create(1 << 20)
    assert arena is not None
    view = ArenaView.open(arena.record)
    data = np.arange(300_000, dtype=np.uint8)
    offset = write(arena, data)
    leased = view.lease(offset, len(data))
    assert np.array_equal(leased, data) and leased.flags.writeable
    tensor = torch.frombuffer(leased, dtype=torch.uint8)[10:20]  # views of views keep the lease
    slice_ = leased[5:]
    del leased
    gc.collect()
    assert view.take_released() == []
    del slice_
    assert view.take_released() == []
    assert tensor[0].item() == 10
    del tensor
    assert view.take_released() == [offset]
    assert arena.free(offset) and arena.allocator.used_bytes == 0
    arena.close()


def test_the_arena_is_full_rather_than_overwritten_and_says_so_once(caplog):
    arena = SharedArena.create(256 * 1024, "channel 'groups'")
    first = write(arena, np.ones(200_000, dtype=np.uint8))
    assert first is not None and write(arena, np.ones(100_000, dtype=np.uint8)) is None
    with caplog.at_level("WARNING", logger="rlinf_pipe.channels.arena"):
        for _ in range(2):
            places, frames, regions, missed = arena.place([np.ones(100_000, np.uint8), np.ones(10, np.uint8)])
            assert places == [None, None] and len(frames) == 2 and regions == []
            assert missed == 100_000  # (the small buffer was never meant for the arena)
            arena.note_overflow(missed)
    assert arena.overflow_bytes == 200_000
    (record,) = caplog.records
    assert "channel 'groups'" in record.getMessage() and "shared_bytes" in record.getMessage()
    arena.free(first)
    assert write(arena, np.ones(100_000, dtype=np.uint8)) == first
    arena.close()


def test_a_view_opens_only_the_arena_its_record_names():
    arena = SharedArena.create(1 << 20)
    record = arena.record
    assert ArenaView.open(ArenaRecord(record.path, "rlp-arena-someone-else", record.size)) is None
    assert ArenaView.open(ArenaRecord(record.path, record.name, record.size * 2)) is None
    assert ArenaView.open(ArenaRecord("/proc/1/fd/999999", record.name, record.size)) is None
    view = ArenaView.open(record)
    with pytest.raises(ValueError, match="outside the arena"):
        view.lease(record.size - 10, 20)
    arena.close()
    assert ArenaView.open(record) is None  # closed: later consumers send over the socket


def test_no_arena_when_sharing_is_off():
    assert SharedArena.create(0) is None


def test_filling_says_when_released_regions_reach_a_quarter_of_the_arena():
    arena = SharedArena.create(1 << 20)
    view = ArenaView.open(arena.record)
    offsets = [write(arena, np.zeros(100_000, dtype=np.uint8)) for _ in range(3)]
    leases = [view.lease(offset, 100_000) for offset in offsets]
    leases.pop()
    leases.pop()
    assert not view.filling()  # 200 KB released of 1 MiB
    leases.pop()
    assert view.filling()  # 300 KB
    arena.close()


def test_a_forked_child_does_not_inherit_a_consumers_mapping():
    """A child that read a region after its parent released it could see another item's bytes: it crashes instead."""
    import ctypes
    import faulthandler
    import os
    import signal
    import time

    arena = SharedArena.create(1 << 20)
    view = ArenaView.open(arena.record)
    leased = view.lease(write(arena, np.full(100_000, 9, dtype=np.uint8)), 100_000)
    address = leased.ctypes.data
    pid = os.fork()
    if pid == 0:  # the child: read one byte of the region, and say so by its exit status
        faulthandler.disable()  # (its crash is expected: no report of it in the test's output)
        os._exit(ctypes.c_ubyte.from_address(address).value)
    deadline = time.monotonic() + 30
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the forked child hung")
        time.sleep(0.01)
    assert os.WIFSIGNALED(status[1]) and os.WTERMSIG(status[1]) == signal.SIGSEGV, status
    assert leased[0] == 9  # (the parent's mapping is untouched)
    arena.close()


def test_a_consumer_link_places_large_buffers_and_frees_only_the_regions_it_holds():
    from rlinf_pipe.channels.links import ConsumerLink, OutItem

    arena = SharedArena.create(1 << 20)
    large, small = np.ones(100_000, dtype=np.uint8), np.ones(10, dtype=np.uint8)
    item = OutItem(1, 0, 1.0, b"h", [large, small], 100_010)
    assert ConsumerLink(0.0).place(item) == (2, item.buffers, 0)  # (it did not map the arena: frames)
    a, b = ConsumerLink(0.0, arena=arena), ConsumerLink(0.0, arena=arena)
    places, frames, missed = a.place(item)
    assert missed == 0
    assert places[0][1] == 100_000 and places[1] is None and len(frames) == 1 and frames[0] is small
    assert a.held == {places[0][0]} and item.regions == [places[0][0]]
    b.release([places[0][0]])  # not b's: nothing happens
    assert arena.allocator.used_bytes > 0
    a.forget_regions(item, free=False)  # (given up: the region stays a's for good)
    assert item.regions == () and arena.allocator.used_bytes > 0
    a.release([places[0][0]])
    assert arena.allocator.used_bytes == 0 and not a.held
    tiny = OutItem(2, 0, 1.0, b"h", [small], 10)
    assert a.place(tiny) == (1, tiny.buffers, 0)
    arena.close()


def test_an_item_goes_into_the_arena_whole_or_not_at_all():
    arena = SharedArena.create(256 * 1024)
    first, second = np.full(100_000, 1, np.uint8), np.full(200_000, 2, np.uint8)
    places, frames, regions, missed = arena.place([first, second])  # 300 KB: no room for both
    assert places == [None, None] and len(frames) == 2 and regions == [] and missed == 300_000
    assert arena.allocator.used_bytes == 0  # (the first one's region was given back, and nothing was copied)
    places, frames, regions, missed = arena.place([first, np.ones(10, np.uint8)])
    assert places[0] == [regions[0], 100_000] and places[1] is None and missed == 0 and len(frames) == 1
    view = ArenaView.open(arena.record)
    assert np.array_equal(view.lease(regions[0], 100_000), first)
    arena.close()


def test_a_process_is_named_by_its_pid_and_start_until_it_exits():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    start = process_start(child.pid)
    assert start is not None and start >= this_process()[1]  # (started after this process)
    child.stdin.close()  # it exits
    child.wait()
    assert process_start(child.pid) is None
    assert this_process() == (os.getpid(), process_start(os.getpid()))


def test_a_given_up_consumers_regions_are_freed_only_once_its_process_is_gone():
    from rlinf_pipe.channels.links import ConsumerLink, OutItem

    arena = SharedArena.create(1 << 20)
    reader = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    alive = ConsumerLink(0.0, arena=arena, reader=(reader.pid, process_start(reader.pid)))
    reused = ConsumerLink(0.0, arena=arena, reader=(os.getpid(), this_process()[1] + 1))  # same pid, later start
    for seq, link in enumerate((alive, reused)):
        link.place(OutItem(seq, 0, 1.0, b"h", [np.ones(100_000, dtype=np.uint8)], 100_000))
        link.dead = "stopped responding"
    one_region = arena.allocator.used_bytes // 2
    assert reused.free_if_gone() == one_region and not reused.held  # (the pid now names another process)
    assert alive.free_if_gone() == 0 and alive.held  # silent, but it may still read them
    reader.stdin.close()
    reader.wait()
    assert alive.free_if_gone() == one_region and not alive.held
    assert arena.allocator.used_bytes == 0
    assert ConsumerLink(0.0).free_if_gone() == 0  # (it mapped nothing)
    arena.close()
