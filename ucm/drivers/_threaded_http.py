"""HTTP requests whose bodies worker threads move straight between a socket and the caller's
memory.

The s3 driver's block GETs and PUTs go through this. Under trio, httpx reads a body in
`bytes` chunks that pass through h11, httpcore and httpx on the event loop's one thread and are
then copied into the block buffer, a fraction of boto3's throughput (figures:
docs/performance.md, "Remote drivers"). Here a worker
thread sends the request with `http.client` and `readinto`s the answer's body where it belongs
(one `recv_into` per socket read, the GIL released, no Python per chunk), or sends a body
made of pieces (a block's header and payload) as they are. Connections are kept alive in a
small pool.

A worker thread cannot be cancelled, and it must never use memory its caller has given up
(write an answer into it, or send a body from it). So when the trio side of a call is
cancelled:

- it marks the call abandoned and shuts its socket down, which wakes a blocked `recv` or
  `send` at once;
- if the thread had not started using the caller's memory, the caller returns at once; the
  thread sees the mark before it does (`Call.writing`) and stops there;
- if it had, the caller waits for it (shielded): after the shutdown it returns within one
  system call.

A stalled server thus costs a deadline, never a thread touching a reused buffer later.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import trio

if TYPE_CHECKING:  # collections.abc.Buffer is new in Python 3.12
    from typing_extensions import Buffer

T = TypeVar("T")

# Errors that mean "the connection failed", as opposed to an answer the caller must judge.
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)
# A kept-alive connection the server closed meanwhile fails like this before any answer: the
# request goes again once on a new connection (it reached no server, so it is safe to repeat).
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
          ConnectionAbortedError)
_DRAIN_LIMIT = 64 * 1024  # bytes of an unread answer read to keep its connection


class Abandoned(Exception):
    """The trio side gave up on this call; the thread stops and its result goes nowhere."""


class ConnectionPool:
    """Keep-alive connections to one origin, for worker threads; `run` calls into them."""

    def __init__(self, origin: str, *, connect_timeout: float, read_timeout: float,
                 max_connections: int, verify_tls: bool) -> None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) origin: {origin!r}")
        self.netloc = parts.netloc
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._tls: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._tls = ssl.create_default_context()
            if not verify_tls:
                self._tls.check_hostname = False
                self._tls.verify_mode = ssl.CERT_NONE
        self._idle: deque[http.client.HTTPConnection] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self.threads = trio.CapacityLimiter(max_connections)

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        if self._tls is not None:
            return http.client.HTTPSConnection(self.netloc, timeout=self.connect_timeout,
                                               context=self._tls), False
        return http.client.HTTPConnection(self.netloc, timeout=self.connect_timeout), False

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and conn.sock is not None:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Closes the idle connections; those in use close when their calls end."""
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), deque()
        for conn in idle:
            conn.close()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(call, *args) in a worker thread, cancellable as the module says."""
        call = Call(self)

        def work() -> T:
            try:
                result = fn(call, *args)
                call._release()
                return result
            except BaseException:
                call._discard()
                raise
            finally:
                call._finished.set()

        try:
            return await trio.to_thread.run_sync(work, abandon_on_cancel=True,
                                                 limiter=self.threads)
        except trio.Cancelled:
            if call._cancel():
                with trio.CancelScope(shield=True):
                    while not call._finished.is_set():
                        await trio.sleep(0.0005)
            raise


class Call:
    """One request's connection, shared by its worker thread and its trio waiter."""

    __slots__ = (
        "_abandoned",
        "_conn",
        "_finished",
        "_lock",
        "_pool",
        "_response",
        "_sock",
        "_writing",
    )

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._abandoned = False
        self._writing = False
        self._sock: socket.socket | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._response: http.client.HTTPResponse | None = None
        self._finished = threading.Event()

    # -- the worker thread's side -----------------------------------------------------------

    def send(self, method: str, target: str, headers: dict[str, str],
             body: tuple[Buffer, ...] = ()) -> http.client.HTTPResponse:
        """Sends a request (target: path and query) whose body is the `body` pieces in order
        (sent as they are, not joined), and returns the answer, its body unread. Sending a
        body counts as using the caller's memory (`writing`)."""
        if self._conn is not None:
            raise RuntimeError("one request per call")
        while True:
            conn, reused = self._pool._take()
            self._conn = conn
            try:
                fresh = conn.sock is None
                if fresh:
                    conn.connect()
                    conn.sock.settimeout(self._pool.read_timeout)
                self._watch(conn.sock)
                conn.putrequest(method, target, skip_accept_encoding=True)
                for name, value in headers.items():
                    conn.putheader(name, value)
                if body or method in ("PUT", "POST"):
                    conn.putheader("Content-Length",
                                   str(sum(memoryview(b).nbytes for b in body)))
                conn.endheaders()
                if body:
                    self.writing()
                for piece in body:
                    conn.sock.sendall(piece)
                self._response = conn.getresponse()
                return self._response
            except _STALE:
                self._discard()
                if not reused:
                    raise

    def writing(self) -> None:
        """Called before the thread first touches the caller's memory (writes an answer into
        it, or sends a body from it): from here on a cancelled caller waits for the thread
        instead of leaving it behind."""
        with self._lock:
            if self._abandoned:
                raise Abandoned
            self._writing = True

    @staticmethod
    def read_into(response: http.client.HTTPResponse, view: memoryview) -> int:
        """Reads the body into `view` until it is full or the body ends; returns the count."""
        got = 0
        while got < view.nbytes:
            n = response.readinto(view[got:])
            if not n:
                break
            got += n
        return got

    def body(self, limit: int = _DRAIN_LIMIT) -> bytes:
        """The rest of a short answer's body (an error's XML); at most `limit` bytes."""
        assert self._response is not None
        return self._response.read(limit)

    def _watch(self, sock: socket.socket) -> None:
        with self._lock:
            if self._abandoned:
                raise Abandoned
            self._sock = sock

    def _release(self) -> None:
        """The connection goes back to the pool if its answer was read to the end."""
        conn, response = self._conn, self._response
        self._conn = self._response = None
        if conn is None:
            return
        if response is not None and not response.isclosed():
            length = response.length
            if length is not None and length <= _DRAIN_LIMIT:
                try:
                    response.read()
                except TRANSPORT_ERRORS:
                    conn.close()
                    return
        if response is None or (response.isclosed() and not response.will_close):
            self._pool._give_back(conn)
        else:
            conn.close()

    def _discard(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = self._response = None

    # -- the trio side ------------------------------------------------------------------------

    def _cancel(self) -> bool:
        """Marks the call abandoned and stops its socket. True if the thread may be writing
        into the caller's memory, so the caller must wait for it."""
        with self._lock:
            self._abandoned = True
            sock, writing = self._sock, self._writing
        if sock is not None:
            try:  # the plain socket's shutdown, also under TLS (SSLSocket's drops its state)
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        return writing
