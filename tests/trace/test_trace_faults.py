"""Tracing faults never take the kernel down; trace files are private; the config refuses
sizes that cannot work; `Kernel.running` tells the truth. Written as a careless operator (a
full disk, a file where the directory should be, a shared directory) would meet them."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from ucm.errors import ConfigError, KernelClosed
from ucm.kernel import Kernel, Load, Store
from ucm.kernel._core import KernelCore
from ucm.trace import SegmentWriter, Tracer, list_segments, read_trace

BLOCK = 4096


def _keys(prefix: int, n: int) -> list[bytes]:
    return [bytes([prefix]) + i.to_bytes(2, "big") + b"f" * 13 for i in range(n)]


def _config(trace: Path) -> dict:
    return {"tiers": [{"driver": "memory", "capacity": "8MiB"}],
            "trace": {"path": str(trace)}}


def _store_and_load(kernel: Kernel, prefix: int) -> None:
    keys = _keys(prefix, 4)
    assert kernel.submit(Store(keys, buffers=[bytes([prefix]) * BLOCK] * 4)).result(10).ok
    buffers = [bytearray(BLOCK) for _ in keys]
    assert kernel.submit(Load(keys, buffers=buffers)).result(10).ok
    assert all(b == bytes([prefix]) * BLOCK for b in buffers)


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + 20
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def _turned_off_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ucm.trace" and "trace files turned off" in r.getMessage()]


@pytest.mark.parametrize("where", ["parent-is-a-file", "file-is-the-directory"])
def test_unwritable_trace_directory_leaves_the_kernel_serving(tmp_path, caplog, where):
    """mkdir fails (ENOTDIR/EEXIST; root is not stopped by chmod, a file in the way stops
    everyone): trace files turn off with one warning, the kernel keeps serving."""
    (tmp_path / "taken").write_text("not a directory")
    trace = tmp_path / "taken" / "trace" if where == "parent-is-a-file" else tmp_path / "taken"
    caplog.set_level(logging.WARNING, logger="ucm.trace")
    with Kernel(_config(trace)) as kernel:
        _store_and_load(kernel, 1)
        _wait_for(lambda: kernel.tracer.write_errors >= 1, "a failed trace write")
        _store_and_load(kernel, 2)
        kernel.tracer.flush()
        assert kernel.running
        stats = kernel.statistics()
        assert stats["trace_write_errors"] == 1
        assert stats["trace_files_disabled"] is True
        assert stats["trace_disabled"] is False
    assert len(_turned_off_warnings(caplog)) == 1
    assert (tmp_path / "taken").read_text() == "not a directory"


def test_full_disk_mid_trace_leaves_the_kernel_serving(tmp_path, monkeypatch, caplog):
    """The disk fills after the segment header: ENOSPC turns trace files off once; the sinks
    keep receiving records; what was written before stays readable."""
    writes = []
    real_write = SegmentWriter._write

    def write(self, data):
        writes.append(len(data))
        if len(writes) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, data)

    monkeypatch.setattr(SegmentWriter, "_write", write)
    consumed = []

    class Sink:
        def consume(self, records):
            consumed.extend(records)

    caplog.set_level(logging.WARNING, logger="ucm.trace")
    tracer = Tracer(tmp_path / "t", sinks=[Sink()], interval=0.05)
    with Kernel({"tiers": [{"driver": "memory"}]}, tracer=tracer) as kernel:
        for prefix in range(1, 6):
            _store_and_load(kernel, prefix)
            kernel.tracer.flush()
        _wait_for(lambda: tracer.write_errors >= 1, "ENOSPC")
        before = len(consumed)
        _store_and_load(kernel, 9)
        assert kernel.running
        stats = kernel.statistics()
        assert stats["trace_write_errors"] == 1 and stats["trace_files_disabled"] is True
    assert len(writes) == 3  # header, one frame, the failed one; then no more attempts
    assert len(consumed) > before  # the sinks still see every event
    assert [m for m in _turned_off_warnings(caplog) if "No space left" in m]
    assert len(_turned_off_warnings(caplog)) == 1
    written = list(read_trace(tmp_path / "t"))  # the frame before the failure, whole
    assert "attach" in [r.phase for r in written]


def test_unexpected_failure_in_serve_turns_tracing_off_not_the_kernel(tmp_path, monkeypatch,
                                                                      caplog):
    def broken(self):
        raise RuntimeError("a bug in the drain")

    monkeypatch.setattr(Tracer, "_take", broken)
    caplog.set_level(logging.ERROR, logger="ucm.trace")
    with Kernel(_config(tmp_path / "t")) as kernel:
        _store_and_load(kernel, 1)
        _wait_for(lambda: kernel.tracer.disabled, "tracing turned off")
        _store_and_load(kernel, 2)
        assert kernel.running
        assert kernel.statistics()["trace_disabled"] is True
        assert kernel.tracer.buffered == 0  # emits are dropped, not piled up
    assert any("tracing turned off" in r.getMessage() for r in caplog.records)


def test_running_is_false_once_the_kernel_thread_died(monkeypatch):
    class Crash(BaseException):
        """Escapes every handler of the event runner, as an interpreter fault would."""

    async def crash(self, event, *, event_id):
        raise Crash("injected")

    died: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    kernel = Kernel({"tiers": [{"driver": "memory"}]})
    kernel.start()
    assert kernel.running
    monkeypatch.setattr(KernelCore, "run", crash)
    kernel.submit(Store(_keys(1, 1), buffers=[bytes(BLOCK)]))  # never resolves: the run dies
    thread = kernel._thread
    assert thread is not None
    thread.join(20)
    assert not thread.is_alive()
    assert died  # the run ended with the injected crash
    assert not kernel.running
    later = kernel.submit(Store(_keys(2, 1), buffers=[bytes(BLOCK)]))
    with pytest.raises(KernelClosed):
        later.result(5)
    kernel.close()
    assert not kernel.running


def test_running_is_false_after_close(tmp_path):
    kernel = Kernel({"tiers": [{"driver": "memory"}]})
    assert not kernel.running
    with kernel:
        assert kernel.running
    assert not kernel.running


@pytest.mark.parametrize(("max_bytes", "segment_bytes", "key"), [
    ("1MiB", "8MiB", "trace.segment_bytes"),
    (0, "8MiB", "trace.max_bytes"),
    ("1MiB", 0, "trace.segment_bytes"),
])
def test_config_refuses_trace_sizes_that_cannot_work(tmp_path, max_bytes, segment_bytes, key):
    config = {"tiers": [{"driver": "memory"}],
              "trace": {"path": str(tmp_path), "max_bytes": max_bytes,
                        "segment_bytes": segment_bytes}}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Kernel(config)
    with pytest.raises(ValueError, match="segment_bytes <= max_bytes"):
        Tracer(tmp_path, max_bytes=1 << 20, segment_bytes=8 << 20)


@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_trace_files_are_private_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        tracer = Tracer(tmp_path / "trace")
        tracer.emit("start", 1, {"type": "Load", "request_id": "secret-prompt-7"})
        tracer.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "trace").stat().st_mode) == 0o700
    [segment] = list_segments(tmp_path / "trace")
    assert stat.S_IMODE(segment.stat().st_mode) == 0o600


def test_world_writable_trace_directory_is_refused(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    caplog.set_level(logging.WARNING, logger="ucm.trace")
    tracer = Tracer(shared)
    tracer.emit("start", 1, {})
    tracer.close()
    assert list(shared.iterdir()) == []
    assert tracer.files_disabled and tracer.write_errors == 1
    [message] = _turned_off_warnings(caplog)
    assert "writable by others" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root")
def test_trace_directory_of_another_user_is_refused(tmp_path, caplog):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    caplog.set_level(logging.WARNING, logger="ucm.trace")
    tracer = Tracer(theirs)
    tracer.emit("start", 1, {})
    tracer.close()
    assert list(theirs.iterdir()) == []
    [message] = _turned_off_warnings(caplog)
    assert "belongs to uid 65534" in message


def test_planted_symlink_at_a_segment_name_is_not_followed(tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (trace / f"trace-{os.getpid()}-000000.ucmtrace").symlink_to(victim)
    tracer = Tracer(trace)
    tracer.emit("start", 1, {})
    tracer.close()
    assert victim.read_bytes() == b"precious"
    assert tracer.segment is None and tracer.write_errors == 0
    assert (trace / f"trace-{os.getpid()}-000001.ucmtrace").is_file()
