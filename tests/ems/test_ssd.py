"""The SSD tier: segment log, checksums, recovery, compaction (real files, in-process)."""

import os
import random

from matrixinfer.ems.ssd import SegmentLog


def test_reopened_log_serves_everything_acknowledged(tmp_path):
    """The index is rebuilt from disk: every put that returned is readable after reopening."""
    log = SegmentLog(str(tmp_path), segment_bytes=1 << 16)
    vals = {f"k{i}": os.urandom(3000 + i) for i in range(60)}  # spans several segments
    for k, v in vals.items():
        log.put("ns", k, memoryview(v))
    log.close()
    log = SegmentLog(str(tmp_path), segment_bytes=1 << 16)
    assert log.recovered == 60 and log.stats()["segments"] > 1
    assert all(log.get("ns", k) == v for k, v in vals.items())


def test_corrupted_value_is_a_miss_not_wrong_bytes(tmp_path):
    """Flipping one byte of a stored value makes its read fail the checksum and return None."""
    log = SegmentLog(str(tmp_path))
    log.put("ns", "a", memoryview(b"A" * 1000))
    log.put("ns", "b", memoryview(b"B" * 1000))
    loc = log.loc("ns", "a")
    log.close()
    path = os.path.join(tmp_path, f"seg-{loc.seg:08d}.log")
    with open(path, "r+b") as f:
        f.seek(loc.val_off + 500)
        f.write(b"X")
    log = SegmentLog(str(tmp_path))
    assert log.get("ns", "a") is None
    assert not log.contains("ns", "a") and log.corrupt_reads == 1
    assert log.get("ns", "b") == b"B" * 1000


def test_torn_tail_is_cut_off_on_recovery(tmp_path):
    """A half-written last record (crash mid-append) is dropped; earlier records survive."""
    log = SegmentLog(str(tmp_path))
    log.put("ns", "ok", memoryview(b"1" * 100))
    log.put("ns", "torn", memoryview(b"2" * 100))
    loc = log.loc("ns", "torn")
    log.close()
    path = os.path.join(tmp_path, f"seg-{loc.seg:08d}.log")
    os.truncate(path, loc.val_off + 50)
    log = SegmentLog(str(tmp_path))
    assert log.get("ns", "ok") == b"1" * 100 and log.get("ns", "torn") is None
    assert os.path.getsize(path) == loc.rec_off
    log.put("ns", "after", memoryview(b"3"))  # appends continue cleanly after the cut
    log.close()
    assert SegmentLog(str(tmp_path)).get("ns", "after") == b"3"


def test_delete_and_overwrite_survive_restart(tmp_path):
    """Tombstones and later versions win on recovery."""
    log = SegmentLog(str(tmp_path))
    log.put("ns", "k", memoryview(b"old"))
    log.put("ns", "k", memoryview(b"new"))
    log.put("ns", "gone", memoryview(b"x"))
    assert log.delete("ns", "gone")
    log.close()
    log = SegmentLog(str(tmp_path))
    assert log.get("ns", "k") == b"new" and log.get("ns", "gone") is None
    assert log.ns_bytes["ns"] == 3


def test_compaction_frees_dead_segments_and_keeps_live_values(tmp_path):
    """Overwriting everything makes old segments dead; compaction deletes them, values stay."""
    log = SegmentLog(str(tmp_path), segment_bytes=1 << 14)
    for rnd in range(3):
        for i in range(20):
            log.put("ns", f"k{i}", memoryview(bytes([rnd]) * 2000))
    before = log.stats()["segments"]
    assert log.compact() > 0
    assert log.stats()["segments"] < before
    log.close()
    log = SegmentLog(str(tmp_path), segment_bytes=1 << 14)
    assert all(log.get("ns", f"k{i}") == bytes([2]) * 2000 for i in range(20))


def test_put_returns_only_after_fsync_and_concurrent_puts_share_fsyncs(tmp_path, monkeypatch):
    """fsync='always': every put is covered by an fsync before it returns, and 16 concurrent
    puts need fewer fsyncs than puts (group commit); fsync='never' does none."""
    import threading

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    log = SegmentLog(str(tmp_path / "a"))
    n0 = len(synced)
    log.put("ns", "k", memoryview(b"v"))
    assert len(synced) == n0 + 1 and log.durable >= (log.seg, log.pos)
    n0 = len(synced)
    threads = [threading.Thread(target=log.put, args=("ns", f"k{i}", memoryview(os.urandom(200_000)))) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 1 <= len(synced) - n0 < 16
    lazy = SegmentLog(str(tmp_path / "b"), fsync="never")
    n0 = len(synced)
    lazy.put("ns", "k", memoryview(b"v"))
    assert len(synced) == n0


def test_group_commit_survives_segment_rotation_under_concurrent_puts(tmp_path, monkeypatch):
    """Eight threads put into one-record segments, so rotations close the active segment while
    another put's group-commit fsync is pending: every put succeeds, every fsync syncs the
    segment it was asked to (not a closed or reused descriptor), and all values survive."""
    import threading
    import time

    real, wrong, rng = os.fsync, [], random.Random(0)

    def slow_fsync(fd):
        before = os.readlink(f"/proc/self/fd/{fd}")
        time.sleep(rng.uniform(0, 0.004))  # widen the window in which a rotation can close it
        if os.readlink(f"/proc/self/fd/{fd}") != before:
            wrong.append(before)
        real(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    log = SegmentLog(str(tmp_path), segment_bytes=4096)
    errors, vals = [], {f"t{t}-{i}": os.urandom(3000) for t in range(8) for i in range(15)}

    def worker(t):
        try:
            for i in range(15):
                log.put("ns", f"t{t}-{i}", memoryview(vals[f"t{t}-{i}"]))
        except OSError as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and wrong == []
    log.close()
    log = SegmentLog(str(tmp_path), segment_bytes=4096)
    assert log.stats()["segments"] >= 100 and all(log.get("ns", k) == v for k, v in vals.items())
