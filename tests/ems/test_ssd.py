"""The SSD tier: segment log, checksums, recovery, compaction (real files, in-process)."""

import os

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
