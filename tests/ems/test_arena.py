"""The DRAM arena allocator and the same-host read validation (in-process)."""

import random

from matrixinfer.ems.arena import ALIGN, Allocator, Arena, ArenaReader


def test_best_fit_picks_the_smallest_hole_that_fits():
    """A request goes to the tightest free extent, not the first one."""
    a = Allocator(64 * 100)
    blocks = [a.alloc(64 * n) for n in (10, 1, 3, 1, 30)]
    a.free(blocks[0])  # hole of 10 units
    a.free(blocks[2])  # hole of 3 units
    assert a.alloc(64 * 3) == blocks[2]


def test_freeing_everything_coalesces_into_one_extent():
    """After random alloc/free, freeing all blocks leaves one extent of the full capacity."""
    rng = random.Random(0)
    a = Allocator(1 << 20)
    live = [a.alloc(rng.randint(1, 20000)) for _ in range(40)]
    live = [b for b in live if b is not None]
    rng.shuffle(live)
    for b in live:
        a.free(b)
    assert a.stats()["free_extents"] == 1 and a.largest_free == a.capacity and a.fragmentation() == 0.0


def test_fragmentation_metric_matches_a_hand_computed_layout():
    """Holes of 1 and 3 units plus a 2-unit tail: 1 - 3/6 = 0.5."""
    a = Allocator(64 * 10)
    b = [a.alloc(64) for _ in range(8)]  # 8 used, tail of 2 free
    a.free(b[1])
    for i in (3, 4, 5):
        a.free(b[i])
    assert a.free_bytes == 64 * 6
    assert abs(a.fragmentation() - 0.5) < 1e-9


def test_fragmentation_under_mixed_size_churn_stays_low():
    """64 KiB-4 MiB values churned at ~80% fill: external fragmentation measured below 0.5."""
    rng = random.Random(1)
    a = Allocator(256 << 20)
    live, fr = [], []
    for _ in range(3000):
        size = rng.choice([64 << 10, 256 << 10, 1 << 20, 4 << 20])
        while (off := a.alloc(size)) is None or a.used_bytes > 0.8 * a.capacity:
            if off is not None:
                a.free(off)
            a.free(live.pop(rng.randrange(len(live))))
        live.append(off)
        fr.append(a.fragmentation())
    assert sum(fr[500:]) / len(fr[500:]) < 0.5


def test_reader_sees_a_block_change_and_refuses_it():
    """A same-host reader gets the bytes while the block is published, None once it is freed."""
    arena = Arena(1 << 20)
    off = arena.allocate(5)
    arena.data(off, 5)[:] = b"hello"
    arena.publish(off, 1234, 5, 99)
    reader = ArenaReader.__new__(ArenaReader)
    reader.buf = arena.buf  # same mapping stands in for the client's read-only one
    assert reader.read_bytes(off, 1234, 5, 99) == b"hello"
    assert reader.read_bytes(off, 1234, 5, 98) is None  # another key's check
    arena.release(off)
    assert reader.read_bytes(off, 1234, 5, 99) is None
    assert off % ALIGN == 0
