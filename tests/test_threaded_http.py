"""ucm.drivers._threaded_http against small HTTP servers on 127.0.0.1 that answer, stall or
drop connections on cue: bodies land in the caller's buffer, connections are reused, a stale
kept-alive connection is retried, and a cancelled call never leaves a thread writing into
the caller's memory."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import trio

from ucm.drivers._threaded_http import Call, ConnectionPool


class Server:
    """Accepts connections on 127.0.0.1 and hands each to `serve(conn)` in a thread."""

    def __init__(self, serve: Callable[[socket.socket], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.release = threading.Event()  # stalled handlers wait for this
        self._serve = serve
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._serve(conn)
            except OSError:
                pass

    def pool(self, **options: float) -> ConnectionPool:
        defaults = {"connect_timeout": 5.0, "read_timeout": 30.0, "max_connections": 4,
                    "verify_tls": True}
        return ConnectionPool(f"http://127.0.0.1:{self.port}", **{**defaults, **options})

    def close(self) -> None:
        self.release.set()
        self.sock.close()


@pytest.fixture
def server_of() -> Iterator[Callable[[Callable[[socket.socket], None]], Server]]:
    servers: list[Server] = []

    def make(serve: Callable[[socket.socket], None]) -> Server:
        servers.append(Server(serve))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    return data


def answer(body: bytes, *, close: bool = False) -> bytes:
    extra = b"Connection: close\r\n" if close else b""
    return (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n" % len(body)) + extra + b"\r\n" + body


def get_into(call: Call, out: memoryview) -> int:
    response = call.send("GET", "/block", {})
    assert response.status == 200
    call.writing()
    return call.read_into(response, out)


async def cancelled_read(pool: ConnectionPool, out: memoryview, *,
                         busy: float = 0.0) -> threading.Event:
    """A GET into `out` cancelled after 0.3 s; checks the caller got back within 2 s (the
    read timeout is 30 s) and returns an event the reading thread sets when it ends. With
    `busy`, the thread takes that long to stop once its read fails (as a thread in the middle
    of a large copy would)."""
    ended = threading.Event()

    def reader(call: Call) -> int:
        try:
            return get_into(call, out)
        finally:
            time.sleep(busy)
            ended.set()

    with trio.move_on_after(0.3) as scope:
        await pool.run(reader)
    assert scope.cancelled_caught
    return ended


async def test_body_lands_in_the_buffer_and_the_connection_is_reused(server_of):
    body = bytes(range(256)) * 8192  # 2 MiB

    def serve(conn: socket.socket) -> None:
        while read_request(conn):
            conn.sendall(answer(body))

    server = server_of(serve)
    pool = server.pool()
    for _ in range(3):
        out = memoryview(bytearray(len(body)))
        assert await pool.run(get_into, out) == len(body)
        assert out == body
    assert server.connections == 1
    pool.close()


async def test_a_kept_alive_connection_the_server_dropped_is_retried_once(server_of):
    def serve(conn: socket.socket) -> None:  # one answer per connection, no "close" header
        if read_request(conn):
            conn.sendall(answer(b"x" * 100))

    server = server_of(serve)
    pool = server.pool()
    for _ in range(3):
        out = memoryview(bytearray(100))
        assert await pool.run(get_into, out) == 100
        await trio.sleep(0.05)  # the server has closed the kept connection by now
    assert server.connections == 3
    pool.close()


async def test_an_answer_that_closes_its_connection_is_not_kept(server_of):
    def serve(conn: socket.socket) -> None:
        if read_request(conn):
            conn.sendall(answer(b"y" * 10, close=True))

    server = server_of(serve)
    pool = server.pool()
    for _ in range(2):
        assert await pool.run(get_into, memoryview(bytearray(10))) == 10
    assert server.connections == 2 and not pool._idle
    pool.close()


async def test_cancel_while_the_body_is_read_waits_for_the_thread(server_of):
    """The thread is writing into the caller's buffer: the cancelled caller returns at once
    (the socket is shut down), and only after the thread stopped writing."""
    size = 8 << 20

    def serve(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"a" * 65536)
        server.release.wait(30)  # stalls mid-body

    server = server_of(serve)
    pool = server.pool()
    out = memoryview(bytearray(size))
    thread_done = await cancelled_read(pool, out, busy=0.3)
    assert thread_done.is_set()  # nothing writes into `out` after the caller moved on
    assert out[:65536] == b"a" * 65536 and out[65536:65537] == b"\0"
    pool.close()


async def test_cancel_before_any_write_abandons_the_thread_at_once(server_of):
    """A server that never answers: the caller returns at its deadline, and the thread, its
    socket shut down, ends without writing."""

    def serve(conn: socket.socket) -> None:
        read_request(conn)
        server.release.wait(30)

    server = server_of(serve)
    pool = server.pool()
    out = memoryview(bytearray(16))
    ended = await cancelled_read(pool, out)
    assert await trio.to_thread.run_sync(ended.wait, 5)
    assert out == bytes(16)
    pool.close()


async def test_a_body_in_pieces_is_sent_whole(server_of):
    received: list[bytes] = []

    def serve(conn: socket.socket) -> None:
        data = read_request(conn)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(1 << 20)
        received.append(body)
        conn.sendall(answer(b""))

    server = server_of(serve)
    pool = server.pool()
    header, payload = b"h" * 4096, memoryview(bytes(range(256)) * 4096)

    def put(call: Call) -> int:
        response = call.send("PUT", "/block", {}, (header, payload))
        return response.status

    assert await pool.run(put) == 200
    assert received == [header + bytes(payload)]
    pool.close()


async def test_cancel_while_a_body_is_sent_waits_for_the_thread(server_of):
    """A server that stops reading: the send blocks once the socket buffers are full; the
    cancelled caller returns at once and only after the thread stopped reading its body."""

    def serve(conn: socket.socket) -> None:
        read_request(conn)
        server.release.wait(30)

    server = server_of(serve)
    pool = server.pool()
    body = memoryview(bytearray(64 << 20))
    ended = threading.Event()

    def put(call: Call) -> None:
        try:
            call.send("PUT", "/block", {}, (body,))
        finally:
            time.sleep(0.3)  # slow to stop, as a thread in the middle of a copy would be
            ended.set()

    with trio.move_on_after(0.3) as scope:
        await pool.run(put)
    assert scope.cancelled_caught
    assert ended.is_set()
    pool.close()
