"""The recorder: a bounded ring that the kernel appends to, and the task that drains it.

`Tracer.emit` runs on the kernel's trio thread and on host threads (`Kernel.submit`). It only
appends a tuple to a `collections.deque` (thread-safe in CPython) with a sequence number from
`itertools.count` (atomic) and a `time.monotonic_ns` stamp: no lock, no I/O. When the ring is
full the oldest records fall out; the drain sees the gap in sequence numbers and counts them.

The drain swaps in a fresh ring and copies the old one with one C call (`list(deque)`), so it
costs next to nothing per record on the GIL; an emit that was about to append to the old ring
during the swap lands there and is picked up by the next drain.

`Tracer.serve` runs in the kernel's nursery: every `interval` (or sooner when the ring is half
full) it drains the ring in a worker thread, writes one compressed frame, and feeds the sinks
(metrics). On exit it drains a last time and closes the segment.

Tracing never takes the kernel down: a trace file that cannot be written (a full or read-only
disk, a refused directory) turns file writing off with one warning and counts the failure
(`write_errors`, in `Kernel.statistics()` as `trace_write_errors`), while the sinks go on; any
other failure in `serve` turns the tracer off with a logged traceback.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgpack
import trio

from ucm.trace._format import SegmentWriter, frame_payloads, pack_default

_now = time.monotonic_ns


def _pack_any(record: tuple[Any, ...]) -> bytes:
    return msgpack.packb(record, default=pack_default)


def _seq_of(chunk: bytes) -> int:
    seq: int = msgpack.unpackb(chunk, strict_map_key=False)[0]
    return seq


def _unpack_all(payload: bytes) -> list[Record]:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(payload)
    return list(unpacker)

log = logging.getLogger("ucm.trace")


def _discard(record: bytes) -> None:
    """The ring's append once tracing is off."""

Record = Sequence[Any]  # [seq, t_ns, phase, event_id, fields]


class Sink(Protocol):
    """Receives every drained batch, in the drain's worker thread, in order."""

    def consume(self, records: Sequence[Record]) -> None: ...


class Tracer:
    """Records kernel events. `path` (a directory) enables trace files; `sinks` receive the
    records too (e.g. `ucm.trace.metrics.MetricsSink`). With neither, records are kept in the
    ring only (see `drain`)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, max_bytes: int = 256 << 20,
                 segment_bytes: int = 8 << 20, ring_events: int = 65536,
                 interval: float = 0.1, sinks: Iterable[Sink] = ()) -> None:
        if ring_events < 2:
            raise ValueError("ring_events must be >= 2")
        if interval <= 0:
            raise ValueError("interval must be > 0 seconds")
        if path is not None and not 0 < segment_bytes <= max_bytes:
            raise ValueError("trace sizes must satisfy 0 < segment_bytes <= max_bytes")
        self.path = Path(path) if path is not None else None
        self.max_bytes = int(max_bytes)
        self.segment_bytes = int(segment_bytes)
        self.ring_events = ring_events
        self.interval = interval
        self.sinks: list[Sink] = list(sinks)
        self._ring: deque[bytes] = deque(maxlen=ring_events)
        self._append = self._ring.append
        self._pack = msgpack.Packer().pack
        self._next_seq = itertools.count().__next__
        # the last swapped-out ring, and the records taken from it
        self._retired: tuple[deque[bytes], int] | None = None
        self._last_seq = -1  # highest sequence number drained
        self._received = 0  # records drained
        self.dropped = 0  # records lost to ring overflow
        self._writer: SegmentWriter | None = None
        self._flush_lock = threading.Lock()  # serve's drain and a caller's flush() may meet
        self._serving = False
        self.write_errors = 0  # failed trace file writes; the first turns file writing off
        self.files_disabled = False  # no more trace files: a write failed, or tracing is off
        self.disabled = False  # tracing off altogether after an unexpected failure

    @classmethod
    def from_config(cls, trace: Any, **kwargs: Any) -> Tracer:
        """From a `ucm.config.TraceConfig`."""
        return cls(trace.path, max_bytes=int(trace.max_bytes),
                   segment_bytes=int(trace.segment_bytes), ring_events=trace.ring_events,
                   **kwargs)

    # -- hot path ------------------------------------------------------------------------------
    def emit(self, phase: str, event_id: int, fields: dict[str, Any]) -> None:
        record = (self._next_seq(), _now(), phase, event_id, fields)
        try:
            # Packed at once: bytes are invisible to the garbage collector, while ring-held
            # tuples and dicts slow every collection (figures: docs/performance.md, Tracing).
            # Packer.pack holds the GIL throughout, so host threads may share it.
            self._append(self._pack(record))
        except Exception:  # a field msgpack cannot encode: the slow path, own packer
            self._append(_pack_any(record))

    # -- draining ------------------------------------------------------------------------------
    def _take(self) -> list[bytes]:
        """Swaps in a fresh ring and returns the packed records of the old one (and any
        emit that raced the previous swap); counts records lost to overflow."""
        old = self._ring
        fresh: deque[bytes] = deque(maxlen=self.ring_events)
        self._ring, self._append = fresh, fresh.append
        chunks: list[bytes] = []
        if self._retired is not None:
            ring, taken = self._retired
            if len(ring) > taken:
                chunks.extend(list(ring)[taken:])
        batch = list(old)  # one C call: atomic under the GIL
        self._retired = (old, len(batch))
        chunks.extend(batch)
        self._received += len(chunks)
        if len(batch) >= self.ring_events:  # only a full ring loses records
            top = _seq_of(chunks[-1])  # about the highest: emits race only by a record
            lost = max(top, self._last_seq) + 1 - self._received
            if lost > self.dropped:
                new = lost - self.dropped
                self.dropped = lost
                log.warning("trace ring overflowed: %d records dropped (%d in all); raise "
                            "trace.ring_events", new, lost)
                chunks.append(_pack_any((-1, _now(), "dropped", 0,
                                         {"count": new, "total": lost})))
        if chunks:
            self._last_seq = max(self._last_seq, _seq_of(chunks[-1]))
        return chunks

    def drain(self) -> list[Record]:
        """Takes every buffered record out of the ring as `(seq, t_ns, phase, event_id,
        fields)`, about in emit order. One caller at a time (see `flush`)."""
        return _unpack_all(b"".join(self._take()))

    def flush(self) -> int:
        """Drains the ring into the trace file and the sinks (blocking). Returns the number
        of records written."""
        with self._flush_lock:
            return self._flush()

    def _flush(self) -> int:
        chunks = self._take()
        if not chunks:
            return 0
        payloads = frame_payloads(chunks)
        if self.path is not None and not self.files_disabled:
            self._write_files(self.path, payloads)
        if self.sinks:
            records = [r for payload in payloads for r in _unpack_all(payload)]
            for sink in self.sinks:
                try:
                    sink.consume(records)
                except Exception:  # a broken sink must not stop the trace
                    log.exception("trace sink %r failed", sink)
        return len(chunks)

    def _write_files(self, path: Path, payloads: list[bytes]) -> None:
        try:
            if self._writer is None:
                self._writer = SegmentWriter(path, max_bytes=self.max_bytes,
                                             segment_bytes=self.segment_bytes)
            for payload in payloads:
                self._writer.write_payload(payload)
        except Exception as exc:  # a full or read-only disk must not stop the kernel
            self._write_failed(exc)

    def _write_failed(self, exc: BaseException) -> None:
        self.write_errors += 1
        if self.files_disabled:
            return
        self.files_disabled = True
        if isinstance(exc, OSError):
            log.warning("trace files turned off: cannot write to %s: %s", self.path, exc)
        else:
            log.warning("trace files turned off: writing to %s failed", self.path,
                        exc_info=exc)
        self._close_writer()

    def _close_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as exc:
                self._write_failed(exc)

    def close(self) -> None:
        """Flushes and closes the current segment; a later flush starts a new one."""
        with self._flush_lock:
            try:
                self._flush()
            finally:
                self._close_writer()

    def _disable(self) -> None:
        """Turns the tracer off: emit drops records, serve stops draining."""
        self.disabled = self.files_disabled = True
        self._append = _discard
        self._ring.clear()

    def statistics(self) -> dict[str, Any]:
        """The tracer's own counters, for `Kernel.statistics()`."""
        return {"trace_write_errors": self.write_errors,
                "trace_files_disabled": self.files_disabled and self.path is not None,
                "trace_disabled": self.disabled, "trace_dropped_records": self.dropped}

    async def serve(self, *, clock: Callable[[], float] = trio.current_time) -> None:
        """Drains the ring until cancelled, then flushes and closes. Run it in the kernel's
        nursery; a second concurrent call returns at once."""
        if self._serving:
            return
        self._serving = True
        half = self.ring_events // 2
        tick = min(self.interval, 0.02)
        try:
            due = clock() + self.interval
            while not self.disabled:
                await trio.sleep(tick)
                if len(self._ring) >= half or clock() >= due:
                    await trio.to_thread.run_sync(self.flush)
                    due = clock() + self.interval
        except Exception:  # never into the kernel's nursery (trio.Cancelled is no Exception)
            log.exception("tracing turned off: the trace drain failed")
            self._disable()
        finally:
            self._serving = False
            try:
                self.close()
            except Exception:
                log.exception("tracing turned off: closing the trace failed")
                self._disable()

    @property
    def buffered(self) -> int:
        return len(self._ring)

    @property
    def segment(self) -> Path | None:
        """The segment being written, if any."""
        return self._writer.current if self._writer is not None else None


_OFF = {"", "0", "off", "false", "no"}


def tracer_from_config(config: Any) -> Tracer | None:
    """The tracer that `config.trace` or the `UCM_TRACE` environment variable (a directory)
    asks for; None when tracing is off. `config.trace` wins."""
    if getattr(config, "trace", None) is not None:
        return Tracer.from_config(config.trace)
    path = os.environ.get("UCM_TRACE", "")
    if path.strip().lower() in _OFF:
        return None
    return Tracer(path)
