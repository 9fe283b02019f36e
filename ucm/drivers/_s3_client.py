"""The S3 client of the `s3` driver: SigV4-signed requests (botocore's signer) with bounded
retries, over two HTTP stacks: httpx on trio for small requests (lookups, listing, deletes,
multipart uploads: a deadline cancels them at once) and `_threaded_http`'s keep-alive pool of
http.client connections for block bodies, which worker threads move straight between the
socket and the block buffer. Also: S3's errors, and the endpoint, region and credentials
resolved from the driver's options and the AWS environment.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote, urlsplit
from xml.etree import ElementTree

import trio

from ucm.drivers._threaded_http import TRANSPORT_ERRORS, Call, ConnectionPool
from ucm.errors import ConfigError, StorageUnavailable

if TYPE_CHECKING:
    import httpx
    from pydantic import SecretStr

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_UNSIGNED = "UNSIGNED-PAYLOAD"
XML_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


class S3Error(Exception):
    """An S3 request failed for good (after retries, or with a status that is not retried)."""

    def __init__(self, message: str, status: int | None = None, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True)
class Target:
    endpoint: str
    bucket: str
    region: str
    virtual: bool

    @property
    def origin(self) -> str:
        if not self.virtual:
            return self.endpoint
        scheme, netloc = self.endpoint.split("://", 1)
        return f"{scheme}://{self.bucket}.{netloc}"

    def url(self, object_key: str = "", query: str = "") -> str:
        path = quote(object_key, safe="/-_.~")
        if self.virtual:
            url = f"{self.origin}/{path}"
        else:
            url = f"{self.endpoint}/{self.bucket}" + (f"/{path}" if object_key else "")
        return f"{url}?{query}" if query else url


def query(**params: str) -> str:
    """A query string encoded the way SigV4 signs it (sorted, RFC 3986)."""
    return "&".join(f"{quote(k.replace('_', '-'), safe='-_.~')}={quote(v, safe='-_.~')}"
                    for k, v in sorted((k.replace("_", "-"), v) for k, v in params.items()))


class S3Client:
    """A small SigV4-signed S3 client on one pooled httpx.AsyncClient, with bounded retries.

    Every method is a checkpoint and cancellable. Statuses in `expect` are returned; others
    raise S3Error (after retries for throttling, 5xx and transport errors).
    """

    def __init__(self, target: Target, credentials: Any, *, connect_timeout: float,
                 read_timeout: float, max_connections: int, max_attempts: int,
                 backoff_base: float, backoff_max: float, verify_tls: bool) -> None:
        import httpx
        from botocore.auth import SigV4Auth

        self.target = target
        self._credentials = credentials
        self._sigv4 = SigV4Auth
        self._httpx = httpx
        self.max_attempts = max_attempts
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.retries = 0
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections),
            verify=verify_tls, follow_redirects=False)
        # Block GETs and PUTs: worker threads move bodies to and from the block buffers.
        self.pool = ConnectionPool(target.origin, connect_timeout=connect_timeout,
                                   read_timeout=read_timeout, max_connections=max_connections,
                                   verify_tls=verify_tls)
        # Requests in flight, bounded here rather than queued in httpcore's pool: its queue
        # is rescanned against every connection (a poll() per idle one) on each assignment.
        self._slots = trio.CapacityLimiter(max_connections)

    def _signed_headers(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        from botocore.awsrequest import AWSRequest

        headers = {"x-amz-content-sha256": _UNSIGNED, **headers}
        request = AWSRequest(method=method, url=url, headers=headers)
        frozen = self._credentials.get_frozen_credentials()
        self._sigv4(frozen, "s3", self.target.region).add_auth(request)
        return dict(request.headers.items())

    async def _backoff(self, attempt: int) -> None:
        self.retries += 1
        await trio.sleep(random.uniform(0, min(self.backoff_max, self.backoff_base * 2**attempt)))

    async def request(self, method: str, object_key: str = "", *, query: str = "",
                      headers: dict[str, str] | None = None, content: Any = None,
                      expect: tuple[int, ...] = (200,)) -> httpx.Response:
        """Sends a request with retries; returns the (read) response for statuses in expect."""
        url = self.target.url(object_key, query)

        async def attempt() -> httpx.Response:
            signed = self._signed_headers(method, url, headers or {})
            try:
                async with self._slots:
                    response = await self.client.request(method, url, headers=signed,
                                                         content=content)
            except self._httpx.TransportError as exc:
                raise Retryable(transport_text(exc)) from None
            if response.status_code in expect:
                return response
            error = _status_error(method, response)
            raise Retryable(error.args[0]) if response.status_code in _RETRY_STATUS else error

        response: httpx.Response = await self.retried(method, attempt)
        return response

    async def retried(self, method: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), again after a backoff while it raises Retryable, max_attempts in all."""
        last = "no attempt"
        for attempt in range(self.max_attempts):
            try:
                return await fn(*args)
            except Retryable as exc:
                last = str(exc)
            if attempt + 1 < self.max_attempts:
                await self._backoff(attempt)
        raise S3Error(f"{method} failed after {self.max_attempts} attempts: {last}")

    async def aclose(self) -> None:
        self.pool.close()
        await self.client.aclose()


class Retryable(Exception):
    pass


def transport_text(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def _status_error(method: str, response: Any) -> S3Error:
    return _error_for(method, response.status_code, response.content)


def _error_for(method: str, status: int, body: bytes) -> S3Error:
    match = re.search(rb"<Code>([^<]+)</Code>", body)
    code = match.group(1).decode() if match else ""
    text = f"{method} -> HTTP {status}" + (f" {code}" if code else "")
    return S3Error(text, status, code)


def drain(call: Call) -> bytes:
    """Worker thread: the rest of an answer's body (so its connection can be reused)."""
    try:
        return call.body()
    except TRANSPORT_ERRORS:
        return b""


def answer_error(call: Call, method: str, status: int) -> Exception:
    """Worker thread: the error for an unexpected answer (its body names the S3 code)."""
    error = _error_for(method, status, drain(call))
    return Retryable(error.args[0]) if status in _RETRY_STATUS else error


def read_body(call: Call, response: Any, view: memoryview) -> int:
    try:
        return call.read_into(response, view)
    except TRANSPORT_ERRORS as exc:
        raise Retryable(transport_text(exc)) from None




def xml_text(node: ElementTree.Element, tag: str) -> str | None:
    found = node.find(XML_NS + tag)
    if found is None:
        found = node.find(tag)
    return None if found is None else found.text


def object_size(status: int, header: Callable[[str, str], str]) -> int:
    if status == 206:
        total = header("content-range", "").rpartition("/")[2]
        if total.isdigit():
            return int(total)
    length = header("content-length", "")
    if not length.isdigit():
        raise Retryable("GET answer without a length")
    return int(length)


def xml_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# -- configuration ---------------------------------------------------------------------------


class Location(Protocol):
    """What `resolve` reads of the driver's options (`S3Driver.Options`): where the bucket is
    and whose credentials open it."""

    @property
    def bucket(self) -> str: ...
    @property
    def endpoint(self) -> str | None: ...
    @property
    def region(self) -> str | None: ...
    @property
    def profile(self) -> str | None: ...
    @property
    def access_key_id(self) -> str | None: ...
    @property
    def secret_access_key(self) -> SecretStr | None: ...
    @property
    def session_token(self) -> SecretStr | None: ...
    @property
    def addressing_style(self) -> str: ...


def resolve(options: Location) -> tuple[Target, Any, str]:
    """Endpoint, region and credentials from the options and the AWS environment. Runs in a
    worker thread: botocore reads ~/.aws files. Returns a description of where the
    credentials came from (never the credentials)."""
    try:
        import botocore.session
        from botocore.credentials import Credentials
    except ImportError as exc:
        raise ConfigError(f"s3 driver needs botocore and httpx ({exc}); install it with: "
                          "pip install 'ucm[s3]'") from None
    try:
        session = botocore.session.Session(profile=options.profile)
        region = (options.region or session.get_config_variable("region")
                  or os.environ.get("AWS_REGION") or "us-east-1")
    except Exception as exc:  # botocore.exceptions.ProfileNotFound and kin
        raise ConfigError(f"profile: {exc}") from None
    credentials: Credentials | None
    if options.access_key_id or options.secret_access_key:
        if not (options.access_key_id and options.secret_access_key):
            raise ConfigError("access_key_id and secret_access_key must be given together")
        token = options.session_token.get_secret_value() if options.session_token else None
        credentials = Credentials(options.access_key_id,
                                  options.secret_access_key.get_secret_value(), token)
        source = "the driver options"
    else:
        try:
            credentials = session.get_credentials()
        except Exception as exc:
            raise ConfigError(f"credentials: {exc}") from None
        if credentials is None:
            raise ConfigError("credentials: none found; set access_key_id/secret_access_key, "
                              "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or a profile in "
                              "~/.aws/credentials")
        source = f"the AWS {getattr(credentials, 'method', 'default')} credentials"
        if options.profile:
            source += f" of profile {options.profile!r}"
    endpoint = (options.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or f"https://s3.{region}.amazonaws.com")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"endpoint: {endpoint!r} is not an http(s) URL")
    target = Target(endpoint.rstrip("/"), options.bucket, region,
                     options.addressing_style == "virtual")
    return target, credentials, source


async def check_bucket(client: S3Client, name: str, source: str) -> None:
    """HEAD the bucket, so bad settings fail at start-up with the reason."""
    target = client.target
    where = f"bucket {target.bucket!r} at {target.endpoint}"
    try:
        response = await client.request("HEAD", expect=(200, 301, 400, 403, 404))
    except S3Error as exc:
        raise StorageUnavailable(f"cannot reach {where}: {exc}", driver=name) from None
    status = response.status_code
    if status == 403:
        raise ConfigError(f"access denied to {where} with {source}: check the access key, "
                          "the secret and the bucket policy")
    if status == 404:
        raise ConfigError(f"bucket: {where} does not exist")
    if status in (301, 400):
        raise ConfigError(f"region: {where} refused region {target.region!r} "
                          f"(HTTP {status}); set region to the bucket's region")

