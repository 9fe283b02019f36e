"""The `redis` driver: blocks as string values on a Redis server (or Valkey, KeyDB...).

    - driver: redis
      url: redis://127.0.0.1:6379/0   # or host/port/db; rediss:// for TLS, unix:///path
      password: null                  # default: the URL's password, else REDIS_PASSWORD
      prefix: ucm                     # keys are <prefix>:<namespace>:<hex key>
      connect_timeout: 5              # seconds to connect
      timeout: 10                     # seconds one command may wait for the server
      pool_size: 8                    # connections, and worker threads for this tier

With neither `url` nor `host`, the address is REDIS_URL, else redis://127.0.0.1:6379. The
password (and user) come from the options, else the URL, else REDIS_PASSWORD (and
REDIS_USERNAME); they are never logged or put in messages.

Each block is one value in the `ucm.block` format (header + payload) written by one SET, so a
reader sees the old or the new whole block, never a part; a writer that dies mid-command leaves
nothing (Redis runs a command only once it arrived whole). Every load verifies the header and
the payload checksum: a damaged value is CORRUPT, never data. A batch is one round trip: a
pipeline of SETs, one MGET, a pipeline of EXISTS, one UNLINK. Keys sit under a per-namespace
prefix, so SCAN lists a namespace (`list_blocks`) and `delete_namespace` removes it.

The client is redis-py's synchronous one (its asyncio client does not run under trio) on one
blocking connection pool, run in worker threads through `_remote.RemoteDriver`: a deadline
abandons a call stuck on a paused server at once, and a late reply never reaches the caller's
buffer (values are verified in the reply's bytes, then copied through `deliver`). A dropped
connection is retried `retries` times (every command here is idempotent) and a stale pooled
connection is replaced on checkout, so the driver recovers from a server restart by itself.
`open` sends a PING: a wrong address, password or db fails there, naming the problem.

`persistent` (default true) says blocks outlive this process: they live in the server. Whether
they outlive a server restart is the server's own setting (RDB/AOF); a server with
`maxmemory` refuses stores when full (counted in `refused_full`) or evicts by its policy, and
an evicted block is a miss. Redis Cluster is not supported (MGET spans hash slots).
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Callable
from typing import Any, Self
from urllib.parse import urlsplit

import trio
from pydantic import (
    ConfigDict,
    Field,
    SecretStr,
    SerializationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from ucm.drivers.contract import DriverOptions
from ucm.drivers.kit import (
    Backend,
    Codec,
    DriverStatistics,
    KVLayouts,
    LoadState,
    RemoteDriver,
    Workers,
    frame_block,
    parse_codec,
    safe_dir_name,
    unframe_into,
)
from ucm.drivers.kit._threaded import with_counters
from ucm.errors import ConfigError, StorageUnavailable

_SCAN_COUNT = 1000
# Bytes asked of the socket per read (redis-py asks for 64 KiB): a 2 MiB value then takes 2
# reads into the parser's buffer instead of 32.
_READ_BYTES = 1 << 20
_GLOB = str.maketrans({c: "\\" + c for c in "*?[]\\"})


class SecretUrl(SecretStr):
    """A URL whose password never shows: str, repr and JSON dumps give it with the password
    (in the user info or a query parameter) replaced by asterisks."""

    def _display(self) -> str:
        return redact_url(self.get_secret_value())


def redact_url(url: str) -> str:
    """`url` with its password, and any query parameter that names a secret, starred out.
    Everything before the last "@" counts as user info, even where a stray "/" or "?" in the
    password would end the authority part of a well-formed URL."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return _STARS if "@" in url else url
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        scheme = f"{scheme}://{user}{':' + _STARS if colon else ''}@"
    else:
        scheme += sep
    where, question, query = rest.partition("?")
    pairs = []
    for pair in query.split("&") if question else []:
        name, eq, _ = pair.partition("=")
        secret = eq and any(word in name.lower() for word in _SECRET_WORDS)
        pairs.append(f"{name}={_STARS}" if secret else pair)
    return scheme + where + question + "&".join(pairs)


_STARS = "**********"
_SECRET_WORDS = ("pass", "secret", "token", "auth", "key")


class RedisOptions(DriverOptions):
    model_config = ConfigDict(hide_input_in_errors=True)  # a rejected url may hold a password

    url: SecretUrl | None = Field(
        default=None, description="redis://[user:password@]host:port/db, rediss:// for TLS, "
        "or unix:///path; its password never shows in messages or dumps")
    host: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    db: int | None = Field(default=None, ge=0)
    username: str | None = None
    password: SecretStr | None = None
    prefix: str = "ucm"
    connect_timeout: float = Field(default=5.0, gt=0)
    timeout: float = Field(default=10.0, gt=0)
    pool_size: int = Field(default=8, ge=1, le=256)
    retries: int = Field(default=1, ge=0, le=10)
    persistent: bool = True

    @field_serializer("url", when_used="unless-none")
    def _dump_url(self, url: SecretUrl, info: SerializationInfo) -> SecretUrl | str:
        return str(url) if info.mode == "json" else url  # JSON: the URL, password starred

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, url: SecretUrl | None) -> SecretUrl | None:
        if url is not None and urlsplit(url.get_secret_value()).scheme not in (
                "redis", "rediss", "unix"):
            raise ValueError("url must start with redis://, rediss:// or unix://")
        return url

    @field_validator("prefix")
    @classmethod
    def _plain_prefix(cls, prefix: str) -> str:
        if any(c.isspace() for c in prefix):
            raise ValueError("prefix must not contain white space")
        return prefix

    @model_validator(mode="after")
    def _one_address(self) -> RedisOptions:
        if self.url is not None and (self.host is not None or self.port is not None):
            raise ValueError("give url or host/port, not both")
        return self


def _address(options: RedisOptions) -> tuple[dict[str, Any], str, str]:
    """Connection keywords, the address without credentials (for messages), and where the
    password came from (never the password)."""
    from redis.connection import parse_url

    url = options.url.get_secret_value() if options.url is not None else None
    if url is None and options.host is None and options.port is None:
        url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379"
    if url is not None:
        try:
            # redis-py leaves parse_url unannotated
            kwargs = parse_url(url)  # type: ignore[no-untyped-call]
        except ValueError as exc:  # its text may quote a piece of a malformed password
            shown = redact_url(url)
            detail = f"{exc}" if shown == url else f"not a valid redis URL: {shown}"
            raise ConfigError(f"url: {detail}") from None
    else:
        kwargs = {"host": options.host or "127.0.0.1", "port": options.port or 6379}
    if options.db is not None:
        kwargs["db"] = options.db
    source = "no password"
    if options.password is not None:
        kwargs["password"], source = options.password.get_secret_value(), "the driver options"
    elif kwargs.get("password"):
        source = "the URL"
    elif os.environ.get("REDIS_PASSWORD"):
        kwargs["password"], source = os.environ["REDIS_PASSWORD"], "REDIS_PASSWORD"
    if options.username is not None:
        kwargs["username"] = options.username
    elif not kwargs.get("username") and os.environ.get("REDIS_USERNAME"):
        kwargs["username"] = os.environ["REDIS_USERNAME"]
    if "path" in kwargs:
        where = f"unix://{kwargs['path']}"
    else:
        scheme = "rediss" if url is not None and url.startswith("rediss:") else "redis"
        where = (f"{scheme}://{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}"
                 f"/{kwargs.get('db', 0)}")
    return kwargs, where, source


def _client(options: RedisOptions, kwargs: dict[str, Any]) -> Any:
    """A redis.Redis on a blocking pool of `pool_size` connections."""
    try:
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry
    except ImportError as exc:
        raise ConfigError(f"redis driver needs the redis client ({exc}); install it with: "
                          "pip install 'ucm[redis]'") from None
    # redis-py leaves BlockingConnectionPool.__init__ unannotated
    pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
        max_connections=options.pool_size, timeout=options.connect_timeout,
        socket_connect_timeout=options.connect_timeout, socket_timeout=options.timeout,
        socket_keepalive=True, socket_read_size=_READ_BYTES,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), options.retries),
        **kwargs)
    return redis.Redis(connection_pool=pool)


class RedisBlocks(Backend):
    """The synchronous side: batches of blocks to and from one redis.Redis."""

    def __init__(self, client: Any, *, prefix: bytes, namespace: str, codec: Codec,
                 where: str, layouts: KVLayouts | None = None) -> None:
        import redis

        self.client = client
        self.prefix = prefix
        self.namespace = namespace
        self._ns = namespace.encode()  # what a loaded header must name
        self.codec = codec
        self.layouts = layouts
        self.where = where
        self._errors = redis.exceptions
        self.counters = {"refused_full": 0}

    def name_of(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Runs one round trip; a failure of the whole call becomes a ConnectionError (an
        OSError: RemoteDriver makes it StorageUnavailable) naming the server."""
        errors = self._errors
        try:
            return fn()
        except errors.AuthenticationError:
            raise ConnectionError(f"redis at {self.where} refused the credentials") from None
        except errors.RedisError as exc:
            raise ConnectionError(f"redis at {self.where}: {exc}") from None

    def _pipeline(self, fill: Callable[[Any], object]) -> list[Any]:
        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            return replies

        replies: list[Any] = self._call(run)
        return replies

    # lookup / delete

    def lookup(self, keys: list[bytes]) -> list[bool]:
        if len(keys) == 1:
            return [self._call(lambda: self.client.exists(self.name_of(keys[0]))) == 1]
        replies = self._pipeline(lambda p: [p.exists(self.name_of(k)) for k in keys])
        self._raise_if_all_failed(replies)
        return [r == 1 for r in replies]

    def delete(self, keys: list[bytes]) -> None:
        for start in range(0, len(keys), _SCAN_COUNT):
            names = [self.name_of(k) for k in keys[start:start + _SCAN_COUNT]]
            self._call(functools.partial(self.client.unlink, *names))

    def _raise_if_all_failed(self, replies: list[Any]) -> None:
        if replies and all(isinstance(r, Exception) for r in replies):
            raise ConnectionError(f"redis at {self.where}: {replies[0]}")

    # store

    def store(self, keys: list[bytes], views: list[memoryview]) -> list[int]:
        values = []
        for key, view in zip(keys, views, strict=True):
            header, payload = frame_block(key, self.namespace, self.codec, view, self.layouts)
            assert isinstance(payload, memoryview)  # a Scatter only from a Scatter
            values.append(header + payload)  # one value, one SET: atomic for readers
        replies = self._pipeline(
            lambda p: [p.set(self.name_of(k), v) for k, v in zip(keys, values, strict=True)])
        sizes = []
        for reply, value in zip(replies, values, strict=True):
            if reply is True:
                sizes.append(len(value))
                continue
            if isinstance(reply, self._errors.OutOfMemoryError):
                self.counters["refused_full"] += 1
            sizes.append(0)
        if not any(sizes) and not all(isinstance(r, self._errors.OutOfMemoryError)
                                      for r in replies):
            self._raise_if_all_failed(replies)
        return sizes

    # load

    def load(self, keys: list[bytes], views: list[memoryview]) -> list[LoadState]:
        names = [self.name_of(k) for k in keys]
        values = self._call(lambda: self.client.mget(names))
        return [self._verify(key, value, out)
                for key, value, out in zip(keys, values, views, strict=True)]

    def _verify(self, key: bytes, value: bytes | None, out: memoryview) -> LoadState:
        if value is None:
            return LoadState.MISSING
        return unframe_into(key, memoryview(value), out, namespace=self._ns)

    # listing

    def scan_page(self, cursor: int, *, delete: bool = False) -> tuple[int, list[Any]]:
        """One SCAN page of this namespace: (next cursor, [(key, bytes stored)]); with
        `delete`, the page's keys are unlinked instead and the names returned."""
        pattern = self.prefix.decode().translate(_GLOB).encode() + b"*"
        cursor, names = self._call(
            lambda: self.client.scan(cursor, match=pattern, count=_SCAN_COUNT))
        if not names:
            return cursor, []
        if delete:
            self._call(lambda: self.client.unlink(*names))
            return cursor, names
        sizes = self._pipeline(lambda p: [p.strlen(n) for n in names])
        self._raise_if_all_failed(sizes)
        items = []
        for name, size in zip(names, sizes, strict=True):
            try:
                key = bytes.fromhex(name[len(self.prefix):].decode())
            except ValueError:
                continue  # not one of ours
            if isinstance(size, int) and size > 0:  # 0: deleted since the SCAN
                items.append((key, size))
        return cursor, items

    def close(self) -> None:
        self.client.connection_pool.disconnect()


class RedisDriver(RemoteDriver):
    """A Redis tier: one value per block under <prefix>:<namespace>:."""

    Options = RedisOptions
    persistent = True

    def __init__(self, backend: RedisBlocks, *, name: str, threads: int,
                 persistent: bool = True, workers: Workers | None = None) -> None:
        super().__init__(backend, name=name, threads=threads, workers=workers)
        self.backend = backend
        self.persistent = persistent

    @classmethod
    async def open(cls, options: RedisOptions | dict[str, Any], *, name: str = "redis",
                   namespace: str, codec: str = "none", layouts: KVLayouts | None = None,
                   workers: Workers | None = None) -> Self:
        if not isinstance(options, RedisOptions):
            options = RedisOptions.model_validate(options)
        codec_value = parse_codec(codec)
        kwargs, where, source = _address(options)
        prefix = (f"{options.prefix}:" if options.prefix else "") + safe_dir_name(namespace)
        client = _client(options, kwargs)
        backend = RedisBlocks(client, prefix=(prefix + ":").encode(), namespace=namespace,
                              codec=codec_value, where=where, layouts=layouts)
        try:
            await trio.to_thread.run_sync(_check_server, backend, name, source,
                                          abandon_on_cancel=True)
        except BaseException:
            backend.close()
            raise
        return cls(backend, name=name, threads=options.pool_size,
                   persistent=options.persistent, workers=workers)

    @property
    def client(self) -> Any:
        """The redis.Redis (tests and tools)."""
        return self.backend.client

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key holding `key`'s block (tests and tools)."""
        return self.backend.name_of(key)

    async def list_blocks(self) -> AsyncIterator[tuple[bytes, int]]:
        seen: set[bytes] = set()  # SCAN may return a key twice
        cursor = 0
        while True:
            cursor, items = await self._run(self.backend.scan_page, cursor)
            for key, size in items:
                if key not in seen:
                    seen.add(key)
                    yield key, size
            if cursor == 0:
                return

    async def delete_namespace(self) -> int:
        """Removes every block of this namespace; returns how many keys went."""
        removed, cursor = 0, 0
        while True:
            cursor, names = await self._run(
                lambda c: self.backend.scan_page(c, delete=True), cursor)
            removed += len(names)
            if cursor == 0:
                return removed

    def statistics(self) -> DriverStatistics:
        return with_counters(super().statistics(), self.backend.counters)


def _check_server(backend: RedisBlocks, name: str, source: str) -> None:
    """PING (which also authenticates and selects the db), so bad settings fail at open."""
    errors = backend._errors
    where = backend.where
    try:
        backend.client.ping()
    except (errors.AuthenticationError, errors.ResponseError) as exc:
        text = str(exc)
        auth = isinstance(exc, errors.AuthenticationError) or "AUTH" in text
        if auth and source == "no password":
            raise ConfigError(f"password: redis at {where} requires one; set password, put "
                              "it in the URL, or set REDIS_PASSWORD") from None
        if auth:
            raise ConfigError(f"password: redis at {where} refused the credentials from "
                              f"{source}; check password, the URL or REDIS_PASSWORD") from None
        if "DB index" in text:
            raise ConfigError(f"db: redis at {where} has no such database ({text})") from None
        raise StorageUnavailable(f"redis at {where} refused PING: {text}", driver=name
                                 ) from None
    except errors.RedisError as exc:
        raise StorageUnavailable(f"cannot reach redis at {where}: {exc}", driver=name
                                 ) from None
