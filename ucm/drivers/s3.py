"""The `s3` driver: blocks as objects in an S3 bucket (AWS S3, SeaweedFS, MinIO, Ceph RGW...).

    - driver: s3
      bucket: kvcache
      endpoint: http://127.0.0.1:8333  # default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / AWS
      prefix: ucm                      # objects are <prefix>/<namespace>/<hex key>
      region: null                     # default: AWS_REGION / the profile's region / us-east-1
      profile: null                    # a profile of ~/.aws/credentials and ~/.aws/config
      access_key_id: null              # explicit credentials win over the AWS environment
      secret_access_key: null

Requests are signed with botocore's SigV4 signer. A block's GET and PUT (below
`multipart_threshold`) run on worker threads that move the body straight between the socket
and the block buffer (`_threaded_http`: http.client, a keep-alive pool), much faster than
httpx on the event loop for 2 MiB blocks (docs/performance.md, "Remote drivers"), and stores
need not join header and payload into one copy. A cancelled one
shuts its socket down and never leaves a thread using a buffer its caller gave up. Lookups,
listing, deletes and multipart uploads run natively on trio (httpx, one pooled client per
driver), so a kernel deadline cancels them at once.

Each object is one block in the `ucm.block` format; a PUT replaces an object atomically, so
readers see the old or the new block, never a mix. Blocks above `multipart_threshold` go up
in parallel parts and come back in parallel ranged GETs pinned to one ETag (If-Match), so a
concurrent overwrite is a retry, never a mixed block.

Failures: throttling (503 SlowDown, 429), other 5xx, timeouts and dropped connections are
retried `max_attempts` times with exponential backoff and full jitter; nothing retries
forever, and the kernel's deadline bounds it all. `open` checks the bucket with a HEAD, so a
wrong endpoint, wrong credentials or a missing bucket fail at start-up, naming the problem.
Credentials come from the options, else botocore's standard chain (AWS_* variables,
AWS_PROFILE, ~/.aws/credentials, ~/.aws/config); they are never logged or put in messages.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, Self
from urllib.parse import urlsplit
from xml.etree import ElementTree

import trio
from pydantic import ByteSize, ConfigDict, Field, SecretStr

from ucm.block import (
    PAYLOAD_OFFSET,
    BlockHeader,
    Codec,
    KVLayouts,
    decode_header,
    decode_payload_into,
    verify_payload,
)
from ucm.drivers._s3_client import (
    XML_NS,
    Retryable,
    S3Client,
    S3Error,
    answer_error,
    check_bucket,
    drain,
    object_size,
    query,
    read_body,
    resolve,
    transport_text,
    xml_escape,
    xml_text,
)
from ucm.drivers._threaded_http import TRANSPORT_ERRORS, Call
from ucm.drivers.contract import DriverOptions, DriverStatistics
from ucm.drivers.kit import (
    LoadState,
    Workers,
    check_batch,
    check_keys,
    count_loads,
    count_stores,
    frame_block,
    new_statistics,
    parse_codec,
    safe_dir_name,
    wrong_size,
)
from ucm.drivers.kit._threaded import with_counters
from ucm.errors import BlockCorrupt, StorageUnavailable

log = logging.getLogger(__name__)

_HEX = re.compile(r"^(?:[0-9a-f]{2})+$")

def _check_into(header: BlockHeader, stored: memoryview, out: memoryview) -> None:
    """Verifies a payload read in place, or decodes a compressed one into `out`."""
    if header.codec is Codec.NONE:
        verify_payload(header, out)
    else:
        decode_payload_into(header, stored, out)


class S3Statistics(DriverStatistics):
    """The contract's counters and the S3 driver's own."""

    multipart_puts: int  # blocks stored in a multipart upload
    ranged_gets: int  # loads that needed ranged GETs past the first part
    etag_races: int  # ranged GETs that found the block replaced (the load restarts)


class S3Driver:
    """Blocks as S3 objects under <prefix>/<namespace>/."""

    persistent = True

    class Options(DriverOptions):
        model_config = ConfigDict(hide_input_in_errors=True)  # a rejected secret stays hidden

        bucket: str = Field(min_length=3, max_length=63)
        endpoint: str | None = None
        prefix: str = "ucm"
        region: str | None = None
        profile: str | None = None
        access_key_id: str | None = None
        secret_access_key: SecretStr | None = None
        session_token: SecretStr | None = None
        addressing_style: Literal["path", "virtual"] = "path"
        verify_tls: bool = True
        connect_timeout: float = Field(default=5.0, gt=0)
        read_timeout: float = Field(default=30.0, gt=0)
        max_attempts: int = Field(default=4, ge=1, le=20)
        backoff_base: float = Field(default=0.05, ge=0)
        backoff_max: float = Field(default=2.0, ge=0)
        max_connections: int = Field(default=32, ge=1)
        batch_concurrency: int = Field(default=16, ge=1)  # requests in flight per batch
        multipart_threshold: ByteSize = Field(default=ByteSize(32 * 2**20), ge=5 * 2**20)
        part_size: ByteSize = Field(default=ByteSize(8 * 2**20), ge=5 * 2**20)

    def __init__(self, client: S3Client, options: Options, *, name: str, namespace: str,
                 codec: Codec, layouts: KVLayouts | None = None) -> None:
        self.client = client
        self.options = options
        self.name = name
        self.namespace = namespace
        self._ns = namespace.encode()  # what a loaded header must name
        self.codec = codec
        self.layouts = layouts
        prefix = options.prefix.strip("/")
        self.key_prefix = (f"{prefix}/" if prefix else "") + safe_dir_name(namespace) + "/"
        self._closed = False
        self._stats: S3Statistics = {**new_statistics(), "multipart_puts": 0,
                                     "ranged_gets": 0, "etag_races": 0}

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    async def open(cls, options: Options | dict[str, Any], *, name: str = "s3", namespace: str,
                   codec: str = "none", layouts: KVLayouts | None = None,
                   workers: Workers | None = None) -> Self:
        if not isinstance(options, cls.Options):
            options = cls.Options.model_validate(options)
        codec_value = parse_codec(codec)
        target, credentials, source = await trio.to_thread.run_sync(resolve, options)
        client = S3Client(target, credentials, connect_timeout=options.connect_timeout,
                          read_timeout=options.read_timeout,
                          max_connections=options.max_connections,
                          max_attempts=options.max_attempts, backoff_base=options.backoff_base,
                          backoff_max=options.backoff_max, verify_tls=options.verify_tls)
        try:
            await check_bucket(client, name, source)
        except BaseException:
            await client.aclose()
            raise
        return cls(client, options, name=name, namespace=namespace, codec=codec_value,
                   layouts=layouts)

    def object_key(self, key: bytes) -> str:
        """The object name of `key` (tests and tools)."""
        return self.key_prefix + key.hex()

    # -- the Driver protocol ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageUnavailable("driver is closed", driver=self.name)

    async def _each(self, fn: Any, items: Sequence[Any]) -> list[Any]:
        """fn(i, item) for every item, batch_concurrency at a time, results in order."""
        results: list[Any] = [None] * len(items)
        if len(items) == 1:
            results[0] = await fn(0, items[0])
            return results
        limiter = trio.CapacityLimiter(self.options.batch_concurrency)

        async def one(i: int, item: Any) -> None:
            async with limiter:
                results[i] = await fn(i, item)

        try:
            async with trio.open_nursery() as nursery:
                for i, item in enumerate(items):
                    nursery.start_soon(one, i, item)
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        return results

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys)
        self._check_open()

        async def found(i: int, key: bytes) -> bool | str:
            try:
                response = await self.client.request("HEAD", self.object_key(key),
                                                     expect=(200, 404))
            except S3Error as exc:
                return str(exc)
            return response.status_code == 200

        results = await self._each(found, keys)
        errors = [r for r in results if isinstance(r, str)]
        if errors:
            raise StorageUnavailable(f"lookup failed: {errors[0]}", driver=self.name)
        self._stats["lookups"] += len(keys)
        self._stats["hits"] += sum(results)
        return results

    async def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[LoadState]:
        keys, views = check_batch(keys, buffers, writable=True)
        self._check_open()
        failures: list[str] = []

        async def one(i: int, key: bytes) -> LoadState:
            view = views[i]
            assert type(view) is memoryview, "a Scatter goes to ScatterLoads drivers only"
            try:
                return await self._load_one(key, view)
            except BlockCorrupt:
                return LoadState.CORRUPT
            except S3Error as exc:
                failures.append(str(exc))
                return LoadState.FAILED

        states: list[LoadState] = await self._each(one, keys)
        count_loads(self._stats, states, views)
        if failures and len(failures) == len(keys):
            raise StorageUnavailable(f"all {len(keys)} reads failed: {failures[0]}",
                                     driver=self.name)
        if failures:  # the states say which; only the log says why
            log.warning("%s: %d of %d reads failed, the first: %s", self.name, len(failures),
                        len(keys), failures[0])
        return states

    async def store(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        keys, views = check_batch(keys, buffers, writable=False)
        self._check_open()
        failures: list[str] = []

        async def one(i: int, key: bytes) -> int:
            view = views[i]
            assert type(view) is memoryview, "check_batch keeps a Scatter only with scatter=True"
            try:
                return await self._store_one(key, view)
            except S3Error as exc:
                failures.append(str(exc))
                return 0

        sizes: list[int] = await self._each(one, keys)
        count_stores(self._stats, sizes)
        if failures and len(failures) == len(keys):
            raise StorageUnavailable(f"all {len(keys)} writes failed: {failures[0]}",
                                     driver=self.name)
        if failures:
            log.warning("%s: %d of %d writes failed, the first: %s", self.name, len(failures),
                        len(keys), failures[0])
        return sizes

    async def delete(self, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        self._check_open()
        names = [self.object_key(k) for k in dict.fromkeys(keys)]
        try:
            await self._delete_objects(names)
        except S3Error as exc:
            raise StorageUnavailable(f"delete failed: {exc}", driver=self.name) from None
        self._stats["deletes"] += len(keys)

    async def list_blocks(self) -> AsyncIterator[tuple[bytes, int]]:
        """Every block of this namespace, by ListObjectsV2 pages of up to 1,000."""
        self._check_open()
        async for name, size in self._list(self.key_prefix):
            stem = name[len(self.key_prefix):]
            # Shorter than a block header: no block (SeaweedFS lists an empty object for a
            # PUT whose client died mid-body).
            if "/" not in stem and _HEX.match(stem) and size >= PAYLOAD_OFFSET:
                yield bytes.fromhex(stem), size

    async def delete_namespace(self) -> int:
        """Deletes every object of this namespace; returns how many (one list + one bulk
        delete per 1,000 objects: cheap because the namespace is a key prefix)."""
        self._check_open()
        count = 0
        page: list[str] = []
        try:
            async for name, _ in self._list(self.key_prefix):
                page.append(name)
                if len(page) == 1000:
                    await self._delete_objects(page)
                    count, page = count + len(page), []
            if page:
                await self._delete_objects(page)
                count += len(page)
        except S3Error as exc:
            raise StorageUnavailable(f"delete namespace failed: {exc}", driver=self.name) from None
        return count

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self.client.aclose()
        await trio.lowlevel.checkpoint()

    def statistics(self) -> DriverStatistics:
        return with_counters(self._stats, {"retries": self.client.retries})

    # -- one block ----------------------------------------------------------------------------

    async def _store_one(self, key: bytes, view: memoryview) -> int:
        header, payload = frame_block(key, self.namespace, self.codec, view, self.layouts)
        size = PAYLOAD_OFFSET + payload.nbytes
        name = self.object_key(key)
        if size > self.options.multipart_threshold:
            await self._multipart_put(name, memoryview(header + payload))
            self._stats["multipart_puts"] += 1
        else:
            await self.client.retried("PUT", self.client.pool.run, self._put, name, header,
                                      payload)
        return size

    def _put(self, call: Call, name: str, header: bytes, payload: memoryview) -> None:
        """Worker thread: one PUT of a block, its header and payload sent from where they
        are (no joined copy)."""
        response = self._send(call, "PUT", name, {}, (header, payload))
        if response.status != 200:
            raise answer_error(call, "PUT", response.status)

    async def _multipart_put(self, name: str, body: memoryview) -> None:
        client = self.client
        response = await client.request("POST", name, query="uploads=")
        upload_id = xml_text(ElementTree.fromstring(response.content), "UploadId")
        if not upload_id:
            raise S3Error("multipart upload: no UploadId in the answer")
        part = int(self.options.part_size)
        ranges = [(i, start, min(start + part, body.nbytes))
                  for i, start in enumerate(range(0, body.nbytes, part), 1)]
        etags: dict[int, str] = {}

        async def upload(_: int, item: tuple[int, int, int]) -> None:
            number, start, end = item
            answer = await client.request(
                "PUT", name, query=query(partNumber=str(number), uploadId=upload_id),
                content=bytes(body[start:end]))
            etags[number] = answer.headers.get("etag", "")

        try:
            await self._each(upload, ranges)
            parts = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{etags[n]}</ETag></Part>"
                            for n in sorted(etags))
            done = await client.request(
                "POST", name, query=query(uploadId=upload_id),
                content=f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode())
            if b"<Error>" in done.content[:512]:  # S3 may report failure inside a 200
                raise S3Error(f"complete multipart upload: {done.content[:200]!r}")
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                try:
                    await client.request("DELETE", name, query=query(uploadId=upload_id),
                                         expect=(204, 200, 404))
                except S3Error:
                    pass  # the bucket's lifecycle rules reap abandoned uploads
            raise

    async def _load_one(self, key: bytes, out: memoryview) -> LoadState:
        """GET the block (its first part by range, the rest in parallel ranged GETs pinned to
        the first answer's ETag) and verify it. A block replaced meanwhile restarts the load."""
        state: LoadState = await self.client.retried("GET", self._get_once, key, out)
        return state

    async def _get_once(self, key: bytes, out: memoryview) -> LoadState:
        name = self.object_key(key)
        first = await self.client.pool.run(self._get_first, name, key, out)
        if first is LoadState.MISSING:
            return first
        header, etag, target = first
        body_end = int(self.options.part_size) - PAYLOAD_OFFSET  # payload the first GET read
        if header.payload_len > body_end:
            self._stats["ranged_gets"] += 1
            await self._get_ranges(name, etag, target, body_end)
            with trio.CancelScope(shield=True):  # a decode writes into out: let it end
                await trio.to_thread.run_sync(_check_into, header, target, out)
        return LoadState.OK

    def _get_first(self, call: Call, name: str, key: bytes, out: memoryview,
                   ) -> Literal[LoadState.MISSING] | tuple[BlockHeader, str, memoryview]:
        """Worker thread: the block's header and first part, read into the caller's buffer
        (or, for a compressed block, a buffer of its own); a block in one part is checked
        here too. Returns the header, the ETag and where the payload went."""
        first = int(self.options.part_size)
        response = self._send(call, "GET", name, {"range": f"bytes=0-{first - 1}"})
        if response.status == 404:
            return LoadState.MISSING
        if response.status == 416:  # a range from byte 0: the object is empty
            # SeaweedFS shows an empty object under the name of a PUT whose client died
            # mid-body (a store never reported as done): no block is there.
            drain(call)
            return LoadState.MISSING
        if response.status not in (200, 206):
            raise answer_error(call, "GET", response.status)
        total = object_size(response.status, response.getheader)
        head = memoryview(bytearray(PAYLOAD_OFFSET))
        filled = read_body(call, response, head)
        if filled < PAYLOAD_OFFSET:
            if filled < total:
                raise Retryable(f"GET body ended after {filled} of {total} bytes")
            raise BlockCorrupt(f"object is {filled} bytes, shorter than a block header")
        header = decode_header(head, expect_key=key, expect_namespace=self._ns)
        if header.raw_len != out.nbytes:
            raise wrong_size(out, header)
        if total != PAYLOAD_OFFSET + header.payload_len:
            raise BlockCorrupt(f"object is {total} bytes, header says "
                               f"{PAYLOAD_OFFSET + header.payload_len}")
        direct = header.codec is Codec.NONE
        target = out if direct else memoryview(bytearray(header.payload_len))
        want = min(header.payload_len, first - PAYLOAD_OFFSET)
        if direct:
            call.writing()
        got = read_body(call, response, target[:want])
        if got < want:
            raise Retryable(f"GET body ended after {PAYLOAD_OFFSET + got} of {total} bytes")
        if want == header.payload_len:
            if not direct:
                call.writing()
            _check_into(header, target, out)
        return header, response.getheader("etag", ""), target

    def _send(self, call: Call, method: str, name: str, headers: dict[str, str],
              body: tuple[Any, ...] = ()) -> Any:
        """Worker thread: a signed request on object `name`; transport failures are
        retryable."""
        url = self.client.target.url(name)
        signed = self.client._signed_headers(method, url, headers)
        path = urlsplit(url)
        try:
            return call.send(method, path.path + (f"?{path.query}" if path.query else ""),
                             signed, body)
        except TRANSPORT_ERRORS as exc:
            raise Retryable(transport_text(exc)) from None

    async def _get_ranges(self, name: str, etag: str, target: memoryview, start: int) -> None:
        part = int(self.options.part_size)
        ranges = [(s, min(s + part, target.nbytes)) for s in range(start, target.nbytes, part)]

        def get(call: Call, lo: int, hi: int) -> None:
            headers = {"range": f"bytes={lo + PAYLOAD_OFFSET}-{hi + PAYLOAD_OFFSET - 1}"}
            if etag:
                headers["if-match"] = etag
            response = self._send(call, "GET", name, headers)
            if response.status in (404, 412):  # replaced or deleted since the first part
                self._stats["etag_races"] += 1
                raise Retryable("the block changed during a ranged load")
            if response.status != 206:
                raise answer_error(call, "GET", response.status)
            if response.length != hi - lo:
                raise Retryable(f"ranged GET answered {response.length} bytes, not {hi - lo}")
            call.writing()
            got = lo + read_body(call, response, target[lo:hi])
            if got != hi:
                raise Retryable(f"ranged GET ended at {got} of {hi}")

        await self._each(lambda _, span: self.client.pool.run(get, *span), ranges)

    # -- listing and bulk delete ----------------------------------------------------------------

    async def _list(self, prefix: str) -> AsyncIterator[tuple[str, int]]:
        token = None
        while True:
            params = {"list_type": "2", "prefix": prefix, "max_keys": "1000"}
            if token:
                params["continuation_token"] = token
            try:
                response = await self.client.request("GET", query=query(**params))
            except S3Error as exc:
                raise StorageUnavailable(f"list failed: {exc}", driver=self.name) from None
            root = ElementTree.fromstring(response.content)
            for item in root.iter(XML_NS + "Contents"):
                yield xml_text(item, "Key") or "", int(xml_text(item, "Size") or 0)
            token = xml_text(root, "NextContinuationToken")
            if (xml_text(root, "IsTruncated") or "false").lower() != "true" or not token:
                return

    async def _delete_objects(self, names: list[str]) -> None:
        if len(names) == 1:
            await self.client.request("DELETE", names[0], expect=(200, 204, 404))
            return

        async def bulk(_: int, chunk: list[str]) -> None:
            objects = "".join(f"<Object><Key>{xml_escape(n)}</Key></Object>" for n in chunk)
            body = f"<Delete><Quiet>true</Quiet>{objects}</Delete>".encode()
            md5 = base64.b64encode(hashlib.md5(body).digest()).decode()
            response = await self.client.request("POST", query="delete=", content=body,
                                                 headers={"content-md5": md5})
            if b"<Error>" in response.content:
                raise S3Error(f"bulk delete reported errors: {response.content[:200]!r}")

        await self._each(bulk, [names[i:i + 1000] for i in range(0, len(names), 1000)])


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error to raise for a failed batch: the first that is not a cancellation."""
    leaves: list[BaseException] = []
    todo: list[BaseException] = [group]
    while todo:
        exc = todo.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            todo[:0] = exc.exceptions
        else:
            leaves.append(exc)
    for exc in leaves:
        if not isinstance(exc, trio.Cancelled):
            return exc
    return leaves[0]
