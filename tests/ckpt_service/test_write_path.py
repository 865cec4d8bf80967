"""The daemon's write path: checksums taken while writing, parallel files, a failed write thread, reads past the
page cache, background threads at the lowest priority."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading

import math

import blake3
import pytest


def _stage_rows(root, t, rows, local_rank, step):
    """Stage the element range ``rows`` of ``t`` the way a rank does."""
    from ckpt_service import staging
    from ckpt_service.capture import Box, Entry, Plan, range_boxes

    flat = t.reshape(-1)
    lo, hi = rows
    boxes = [Box(o, s, flat[f:f + math.prod(s)]) for o, s, f in range_boxes(list(t.shape), lo, hi)]
    plan = Plan([Entry(("model", "w"), list(t.shape), t.dtype, boxes)], {"model": {}, "lr": 1}, "test")
    slot = staging.Slot(staging.slot_path(str(root), local_rank, 0))
    nbytes = plan.layout()
    slot.ensure(nbytes)
    plan.copy_into(slot.buf)
    return {"step": step, "rank": local_rank, "local_rank": local_rank, "slot": slot.path, "slot_ino": slot.ino,
            "nbytes": nbytes, "entries": plan.describe(), "plain": plan.plain, "_slot": slot}


def _descs(tmp_path, torch, step=7):
    from ckpt_service import staging

    t = torch.arange(4096.0 * 33).reshape(33, 4096)
    descs = [_stage_rows(tmp_path / "shm", t, (0, 70_001), 0, step),
             _stage_rows(tmp_path / "shm", t, (70_001, t.numel()), 1, step)]
    meta = {"job_id": "t", "config_digest": "0" * 64, "config": {}, "world_size": 2, "layout": [1, 2],
            "extra_json": json.dumps({"run": {}, "ranks": {}}), "capture": None}
    for d in descs:
        d["meta"] = meta
        d["buf"] = staging.map_slot(d["slot"], d["slot_ino"], d["nbytes"])
    return t, descs


def test_checksums_taken_while_writing_match_the_disk_and_stock_dcp_loads_it(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ckpt_service import dcp_write, sink, writecheck
    from ckpt_service.verify import verify_snapshot

    t, descs = _descs(tmp_path, torch)
    timings: dict[str, float] = {}
    path, size = dcp_write.write_snapshot(str(tmp_path / "node"), 7, descs, node="n", timings=timings, key=b"k" * 32)
    manifest = json.loads((tmp_path / "node" / "step-0000000007" / "manifest.json").read_text())
    data = [n for n in manifest["files"] if n.endswith(".distcp")]
    assert len(data) == sink.WRITE_THREADS  # the tensors went to one file per write thread
    for name, want in manifest["files"].items():
        raw = (tmp_path / "node" / "step-0000000007" / name).read_bytes()
        assert want["size"] == len(raw) and want["blake3"] == blake3.blake3(raw).hexdigest()
        assert writecheck.hash_file(os.path.join(path, name), drop=True) == want["blake3"]
    assert verify_snapshot(path, b"k" * 32)[0]
    back = {"model": {"w": torch.zeros_like(t)}, "lr": 0, "extra": {"json": ""}}
    dcp.load(back, storage_reader=dcp.FileSystemReader(path), no_dist=True)  # stock load
    assert torch.equal(back["model"]["w"], t)
    # a byte changed on the disk after the commit is found by the verification's re-read
    victim = os.path.join(path, data[0])
    with open(victim, "r+b") as fh:
        fh.seek(os.path.getsize(victim) // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 1]))
    ok, why = verify_snapshot(path, b"k" * 32)
    assert not ok and "fails its BLAKE3 checksum" in why


def test_a_failed_write_thread_fails_the_snapshot(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")

    from accelpact_slurm.core.errors import CheckpointError
    from ckpt_service import dcp_write, sink

    if sink.WRITE_THREADS < 2:
        pytest.skip("one write thread on this machine")
    _t, descs = _descs(tmp_path, torch)
    real = sink.HashingFile._write

    def flaky(self, mv):
        if threading.current_thread() is not threading.main_thread() and self.path.endswith(".distcp"):
            raise OSError(errno.ENOSPC, "No space left on device")  # only DCP's extra write thread fails
        return real(self, mv)

    monkeypatch.setattr(sink.HashingFile, "_write", flaky)
    with pytest.raises(CheckpointError, match="No space left"):
        dcp_write.write_snapshot(str(tmp_path / "node"), 7, descs, node="n")
    assert not [n for n in os.listdir(tmp_path / "node") if "step" in n]  # nothing half-written left


def test_background_threads_lower_only_their_own_priority():
    from ckpt_service.daemon import BACKGROUND, lower_priority

    before = (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else 0)
    seen = []

    def bg():
        seen.append(lower_priority(19))
        seen.append(lower_priority("idle"))

    th = threading.Thread(target=bg)
    th.start()
    th.join(timeout=10)
    assert seen[0] in (19, None) and seen[1] in ("idle", 19, None)  # None: priorities cannot be told here
    after = (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else 0)
    assert after == before  # the calling thread (the daemon's accept thread, say) keeps its priority
    assert set(BACKGROUND) == {"ckptd-writer", "ckptd-verifier", "ckptd-tier", "ckptd-deleter"}


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("setting, policy", [(None, "SCHED_IDLE"), ("0", "SCHED_OTHER")])
def test_the_daemons_writer_runs_idle_unless_the_setting_says_otherwise(monkeypatch, setting, policy):
    """ACCELPACT_CKPTD_IDLE=0 (a machine shared with other busy work) keeps the worker threads off SCHED_IDLE."""
    import queue

    from ckpt_service import daemon

    if setting is None:
        monkeypatch.delenv("ACCELPACT_CKPTD_IDLE", raising=False)
    else:
        monkeypatch.setenv("ACCELPACT_CKPTD_IDLE", setting)
    q: queue.Queue = queue.Queue()
    seen = []
    q.put(1)
    q.put(daemon._SENTINEL)
    th = threading.Thread(target=daemon.Daemon._worker, args=(None, q, lambda _: seen.append(os.sched_getscheduler(0))),
                          name="ckptd-writer")
    th.start()
    th.join(timeout=10)
    assert seen == [getattr(os, policy)]


def test_no_write_thread_computes_torch_saves_crc(tmp_path, monkeypatch):
    """torch keeps its CRC-32 option per thread: DCP's second write thread had it on (about 0.7 CPU-s per GiB for
    a check the manifest's digest makes anyway).  Every write is made with it off, on every thread.  Negative
    control: with the option turned off in the calling thread only (the stream's own ``_no_zip_crc`` removed),
    the second thread's writes see it on."""
    torch = pytest.importorskip("torch")
    from torch.utils.serialization import config

    from ckpt_service import dcp_write, sink

    if sink.WRITE_THREADS < 2:
        pytest.skip("one write thread on this machine")
    seen: dict[str, set[bool]] = {}
    real = sink.HashingFile.write

    def spy(self, b):
        seen.setdefault(threading.current_thread().name, set()).add(config.save.compute_crc32)
        return real(self, b)

    monkeypatch.setattr(sink.HashingFile, "write", spy)
    _t, descs = _descs(tmp_path, torch)
    dcp_write.write_snapshot(str(tmp_path / "node"), 7, descs, node="n")
    assert len(seen) >= 2, seen  # DCP's own thread wrote too
    assert all(v == {False} for v in seen.values()), seen
    assert config.save.compute_crc32 is True  # and it is back on here afterwards


@pytest.mark.parametrize("sizes", [[1], [4095], [4096], [4097, 3], [(8 << 20) - 1, 2], [8 << 20], [(8 << 20) + 5000, 70000],
                                   [100] * 300 + [5 << 20] + [3] * 7])
def test_a_direct_sink_writes_exactly_the_bytes_given(tmp_path, sizes):
    """The sink writes past the page cache where the file system allows it (the development machine's /tmp:
    ext4) through its page-aligned buffer, the tail's partial page through the page cache: the file holds
    exactly the bytes given, in order, for sizes around the page and the buffer's bounds."""
    from ckpt_service import sink as sink_mod

    data = os.urandom(sum(sizes))
    sink = sink_mod.Sink(str(tmp_path / "f"))
    if not sink.direct:
        sink.close()
        pytest.skip("no direct I/O on this file system")
    h = blake3.blake3()
    at = 0
    for n in sizes:
        sink.put(memoryview(data)[at:at + n], h)
        at += n
    assert sink.finish() == len(data)
    sink.close()
    assert (tmp_path / "f").read_bytes() == data
    assert h.hexdigest() == blake3.blake3(data).hexdigest()  # every byte hashed once, in order


def test_direct_writes_refused_after_the_open_go_through_the_page_cache(tmp_path, monkeypatch):
    """A file system may open a file for direct I/O and refuse its writes (EINVAL): the sink then writes the
    same bytes through the page cache, none lost or doubled.  Control: without the fallback (the buffer
    written as it is) the same writes raise."""
    from ckpt_service import sink as sink_mod

    real = os.write
    refused = []

    def write(fd, b):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(b))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, b)

    monkeypatch.setattr(sink_mod.os, "write", write)
    data = os.urandom((8 << 20) * 2 + 12345)
    sink = sink_mod.Sink(str(tmp_path / "f"))
    if not sink.direct:
        sink.close()
        pytest.skip("no direct I/O on this file system")
    sink.put(memoryview(data)[:100])
    sink.put(memoryview(data)[100:])
    assert sink.finish() == len(data)
    sink.close()
    assert refused and not sink.direct
    assert (tmp_path / "f").read_bytes() == data

    monkeypatch.setattr(sink_mod.Sink, "_direct_write", lambda self, mv: sink_mod._write_all(self.fd, mv))
    sink = sink_mod.Sink(str(tmp_path / "g"))
    with pytest.raises(OSError, match="Invalid argument"):
        sink.put(memoryview(data))
    sink.close()


def test_a_file_system_that_refuses_direct_io_at_the_open_gets_the_page_cache(tmp_path, monkeypatch):
    """Where the open with O_DIRECT fails with EINVAL (file systems without direct I/O; every one on this
    machine has it, so the refusal is played), the sink opens the file for the page cache and writes it
    whole; any other error of the open is the caller's."""
    from ckpt_service import sink as sink_mod

    real = os.open

    def refusing(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a)

    monkeypatch.setattr(sink_mod.os, "open", refusing)
    data = os.urandom(10000)
    sink = sink_mod.Sink(str(tmp_path / "f"))
    assert not sink.direct
    sink.put(memoryview(data))
    assert sink.finish() == len(data)
    sink.close()
    assert (tmp_path / "f").read_bytes() == data
    with pytest.raises(FileNotFoundError):
        sink_mod.Sink(str(tmp_path / "missing" / "f"))


def _page_aligned(data: bytes):
    """``data`` in an anonymous mapping: its first byte on a page, as a staged slot's large boxes are."""
    import mmap

    m = mmap.mmap(-1, len(data) + 8192)
    m[:len(data)] = data
    return m


@pytest.mark.parametrize("offset", [0, 64])
def test_a_large_span_on_a_page_goes_to_the_disk_from_where_it_lies(tmp_path, offset):
    """A span of ``DIRECT_SPAN`` bytes or more that starts on a page, in memory and in the file, is written
    from where it lies (its whole pages: ``sink.spans``), the buffered bytes before it first, its last partial
    page copied: the file holds exactly the bytes given, hashed once, in order.  Control (offset 64): the same
    bytes off a page are all copied, no span, the same file."""
    from ckpt_service import sink as sink_mod

    big = os.urandom((3 << 20) + 777)
    other = os.urandom(2 << 20)
    m1, m2 = _page_aligned(b"\0" * offset + big), _page_aligned(other)
    head = os.urandom(100)
    pad = bytes(-(len(head)) % 4096)
    tail = os.urandom(50)
    pad2 = bytes(-(len(head) + len(pad) + len(big) + len(tail)) % 4096)
    pieces = [memoryview(head), memoryview(pad), memoryview(m1)[offset:offset + len(big)], memoryview(tail),
              memoryview(pad2), memoryview(m2)[:len(other)], memoryview(tail)]
    data = b"".join(bytes(p) for p in pieces)
    sink = sink_mod.Sink(str(tmp_path / "f"))
    if not sink.direct:
        sink.close()
        pytest.skip("no direct I/O on this file system")
    h = blake3.blake3()
    for p in pieces:
        sink.put(p, h)
    assert sink.finish() == len(data)
    sink.close()
    assert (tmp_path / "f").read_bytes() == data
    assert h.hexdigest() == blake3.blake3(data).hexdigest()
    if offset == 0:
        assert sink.spans == (3 << 20) + (2 << 20)  # both spans' whole pages from where they lay
    else:
        assert sink.spans == 2 << 20  # the first span is off a page: copied; the second one still goes as it lies


def test_a_span_refused_direct_io_after_the_open_goes_through_the_page_cache(tmp_path, monkeypatch):
    """A span written with the buffered bytes before it (one vectored write) that the file system refuses
    (EINVAL) goes through the page cache, none of its bytes lost or doubled."""
    from ckpt_service import sink as sink_mod

    real_write, real_writev = os.write, os.writev

    def refuse(fd):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(sink_mod.os, "write", lambda fd, b: (refuse(fd), real_write(fd, b))[1])
    monkeypatch.setattr(sink_mod.os, "writev", lambda fd, bs: (refuse(fd), real_writev(fd, bs))[1])
    big = os.urandom(2 << 20)
    m = _page_aligned(big)
    head = os.urandom(4096)
    sink = sink_mod.Sink(str(tmp_path / "f"))
    if not sink.direct:
        sink.close()
        pytest.skip("no direct I/O on this file system")
    sink.put(memoryview(head))
    sink.put(memoryview(m)[:len(big)])
    assert sink.finish() == len(head) + len(big)
    sink.close()
    assert not sink.direct
    assert (tmp_path / "f").read_bytes() == head + big


@pytest.mark.parametrize("placed", [True, False])
def test_large_boxes_are_written_from_the_slot_each_on_a_page_of_its_file(tmp_path, monkeypatch, placed):
    """Every DCP item of ``PLACE_FROM`` bytes or more starts on a page of its file and its ``torch.save``
    record's data too, so the sink writes the box from the slot (``from_slot``: at least every large box's
    whole pages); the files still verify and stock ``dcp.load`` reads the state bit for bit.  Control
    (``placed`` False: DCP's own file writing, no padding): the large items are not all on pages and less is
    written from the slots."""
    import io
    import zipfile

    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ckpt_service import dcp_write, sink, staging
    from ckpt_service.verify import verify_snapshot

    if not placed:
        monkeypatch.setattr(dcp_write, "can_place_items", lambda: False)
    t = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3))  # 4 MiB: two boxes of ~2 MiB
    small = torch.arange(300.0)
    descs = [_stage_rows(tmp_path / "shm", t, (0, 500_001), 0, 7), _stage_rows(tmp_path / "shm", t, (500_001, t.numel()), 1, 7)]
    meta = {"job_id": "t", "config_digest": "0" * 64, "config": {}, "world_size": 2, "layout": [1, 2],
            "extra_json": json.dumps({"run": {}, "ranks": {}}), "capture": None}
    for d in descs:
        d["meta"] = meta
        d["plain"] = {"model": {}, "lr": 1, "small": small}
        d["buf"] = staging.map_slot(d["slot"], d["slot_ino"], d["nbytes"])
    large = [s for d in descs for e in d["entries"] for _o, s, _b in e["boxes"] if math.prod(s) * 4 >= sink.PLACE_FROM]
    assert len(large) == 2
    from_slot: dict[str, int] = {}
    path, _ = dcp_write.write_snapshot(str(tmp_path / "node"), 7, descs, node="n", key=b"k" * 32, from_slot=from_slot)
    assert verify_snapshot(path, b"k" * 32)[0]
    back = {"model": {"w": torch.zeros_like(t)}, "lr": 0, "small": torch.zeros_like(small), "extra": {"json": ""}}
    dcp.load(back, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert torch.equal(back["model"]["w"], t) and torch.equal(back["small"], small)
    md = dcp.FileSystemReader(path).read_metadata()
    on_pages = []
    for index, info in md.storage_data.items():
        if index.fqn != "model.w" or info.length < sink.PLACE_FROM:  # the two large boxes' items
            continue
        raw = open(os.path.join(path, info.relative_path), "rb").read()[info.offset:info.offset + info.length]
        record = zipfile.ZipFile(io.BytesIO(raw))
        zi = next(z for z in record.infolist() if z.filename.endswith("/data/0"))
        local = raw[zi.header_offset:zi.header_offset + 30]
        start = zi.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
        on_pages.append(info.offset % 4096 == 0 and (info.offset + start) % 4096 == 0)
    whole = sum(math.prod(s) * 4 // 4096 * 4096 for s in large)
    if placed:
        assert on_pages == [True, True]
        assert sum(from_slot.values()) >= whole
    else:
        assert not all(on_pages) and sum(from_slot.values()) < whole
