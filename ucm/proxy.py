"""`ucm proxy`: an OpenAI-compatible front for prefill/decode disaggregation through ucm.

    ucm proxy --prefill URL[,URL...] --decode URL[,URL...] [--host 127.0.0.1] [--port 8000]
              [--route roundrobin] [--prefill-timeout 600]

Each POST to /v1/completions or /v1/chat/completions goes first to a prefill instance (`ucm
serve --kv-role producer`) with `max_tokens` 1 and streaming off: it computes the prompt's KV
and stores its full blocks in ucm. The original request then goes to a decode instance (`ucm
serve --kv-role consumer`), which loads those blocks from ucm (waiting up to its
`consumer_wait` for blocks still being written) and generates; its answer is the client's,
streamed chunk by chunk when the request streams. Instances are taken in turn (round robin).

Errors: a prefill or decode instance's error answer (a status of 400 or more) is passed to the
client with its status and body. A prefill instance that cannot be reached, or has not answered
within `--prefill-timeout` seconds (a hung instance), is skipped for the next one; when none
answers the request goes to the decode instance alone, which recomputes the prompt (after its
bounded wait, counted in its metrics): an answer rather than an outage, marked in the
`x-ucm-prefill: unavailable` response header. A decode instance that
cannot be reached is skipped for the next one; when none can be reached the answer is 502 with
an error naming them. GET /v1/models is a decode instance's, GET /health the proxy's own.

Built on Starlette (routing, streaming responses), uvicorn (the server) and httpx (the async
client with streamed bodies): vLLM's OpenAI server runs on the same three, so they are
installed wherever `ucm serve` runs; elsewhere the `proxy` extra installs them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger("ucm.proxy")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
ROUTES = ("roundrobin",)
CONNECT_TIMEOUT = 5.0  # seconds to reach an instance before trying the next one
READ_TIMEOUT = 600.0  # seconds an instance may take between two bytes of its answer
PREFILL_TIMEOUT = 600.0  # seconds a prefill answer may take in all, by default
# Request headers passed on to the instances (vLLM's --api-key reads Authorization).
_FORWARDED = ("authorization", "x-request-id")


def parse_urls(value: str, option: str) -> list[str]:
    """The comma-separated instance URLs of `option`; an error names a bad one."""
    urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"{option} needs at least one URL")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{option}: {url!r} is not an http(s)://HOST[:PORT] URL")
    return urls


class RoundRobin:
    """Instances in turn: each call's order starts one further on (the rest follow, for
    when the first cannot be reached)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self._next = itertools.count()

    def order(self) -> list[str]:
        start = next(self._next) % len(self.urls)
        return self.urls[start:] + self.urls[:start]


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill instance gets: one token, not streamed, one choice."""
    out = dict(body, max_tokens=1, stream=False, n=1)
    out.pop("stream_options", None)  # vLLM refuses it without streaming
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if out.get("min_tokens"):
        out["min_tokens"] = 0
    return out


def _error(status: int, message: str) -> Response:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "ucm_proxy", "code": status}},
                        status_code=status)


def _passed(response: httpx.Response, headers: dict[str, str]) -> Response:
    """An instance's complete answer, status, body and content type as it gave them."""
    from starlette.responses import Response

    return Response(response.content, status_code=response.status_code, headers=headers,
                    media_type=response.headers.get("content-type"))


class Proxy:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str],
                 route: str = "roundrobin", prefill_timeout: float = PREFILL_TIMEOUT) -> None:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, not {route!r}")
        if not prefill_timeout > 0:
            raise ValueError(f"prefill_timeout must be more than 0 s, not {prefill_timeout}")
        self.prefill_timeout = prefill_timeout
        self.prefill, self.decode = RoundRobin(prefill), RoundRobin(decode)
        self.client: httpx.AsyncClient | None = None
        self.counts: dict[str, int] = {"requests": 0, "prefill_unavailable": 0,
                                       "prefill_timeouts": 0,
                                       "decode_unavailable": 0, "upstream_errors": 0}

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        import httpx

        timeout = httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=64)) as client:
            self.client = client
            yield
            self.client = None

    def app(self) -> Starlette:
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(lifespan=self.lifespan, routes=[
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ])

    async def health(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        return JSONResponse({"prefill": self.prefill.urls, "decode": self.decode.urls,
                             **self.counts})

    async def models(self, request: Request) -> Response:
        import httpx

        assert self.client is not None
        for url in self.decode.order():
            try:
                return _passed(await self.client.get(url + "/v1/models",
                                                     headers=_headers(request)), {})
            except httpx.TransportError:
                continue
        return _error(502, f"ucm proxy: no decode instance reachable ({self.decode.urls})")

    async def generate(self, request: Request) -> Response:
        import httpx

        assert self.client is not None
        self.counts["requests"] += 1
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return _error(400, f"ucm proxy: the request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "ucm proxy: the request body must be a JSON object")
        path, headers = request.url.path, _headers(request)
        prefilled = "unavailable"
        for url in self.prefill.order():
            try:
                answer = await asyncio.wait_for(self.client.post(
                    url + path, json=prefill_body(body), headers=headers),
                    self.prefill_timeout)
            except httpx.TransportError as exc:
                log.warning("ucm proxy: prefill instance %s: %r", url, exc)
                continue
            except TimeoutError:  # a hung instance: the request moves on without it
                self.counts["prefill_timeouts"] += 1
                log.warning("ucm proxy: prefill instance %s did not answer in %g s", url,
                            self.prefill_timeout)
                continue
            if answer.status_code >= 400:  # the decode instance would refuse it the same
                self.counts["upstream_errors"] += 1
                return _passed(answer, {"x-ucm-prefill": url})
            prefilled = url
            break
        if prefilled == "unavailable":
            self.counts["prefill_unavailable"] += 1
            log.warning("ucm proxy: no prefill instance reachable (%s); the decode instance "
                        "computes the prompt", ", ".join(self.prefill.urls))
        return await self._decode(path, body, headers, {"x-ucm-prefill": prefilled})

    async def _decode(self, path: str, body: dict[str, Any], headers: dict[str, str],
                      marks: dict[str, str]) -> Response:
        import httpx
        from starlette.background import BackgroundTask
        from starlette.responses import StreamingResponse

        assert self.client is not None
        for url in self.decode.order():
            marks = {**marks, "x-ucm-decode": url}
            request = self.client.build_request("POST", url + path, json=body, headers=headers)
            try:
                answer = await self.client.send(request, stream=True)
            except httpx.ConnectError as exc:  # never reached it: the next one may serve
                log.warning("ucm proxy: decode instance %s: %s", url, exc)
                continue
            except httpx.TransportError as exc:  # it may have started: not sent twice
                return _error(502, f"ucm proxy: decode instance {url}: {exc!r}")
            if answer.status_code >= 400 or not body.get("stream"):
                try:
                    await answer.aread()
                finally:
                    await answer.aclose()
                if answer.status_code >= 400:
                    self.counts["upstream_errors"] += 1
                return _passed(answer, marks)
            return StreamingResponse(answer.aiter_bytes(), status_code=answer.status_code,
                                     headers=marks,
                                     media_type=answer.headers.get("content-type"),
                                     background=BackgroundTask(answer.aclose))
        self.counts["decode_unavailable"] += 1
        return _error(502, f"ucm proxy: no decode instance reachable "
                           f"({', '.join(self.decode.urls)})")


def _headers(request: Request) -> dict[str, str]:
    return {k: request.headers[k] for k in _FORWARDED if k in request.headers}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ucm proxy", description="OpenAI-compatible front for prefill/decode "
        "disaggregation: each request is prefilled on a prefill instance (max_tokens 1), "
        "then answered by a decode instance that loads the prompt's KV from ucm")
    parser.add_argument("--prefill", required=True, metavar="URL[,URL...]",
                        help="prefill instances (ucm serve --kv-role producer)")
    parser.add_argument("--decode", required=True, metavar="URL[,URL...]",
                        help="decode instances (ucm serve --kv-role consumer)")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="address to listen on (default: %(default)s, loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="port to listen on (default: %(default)s)")
    parser.add_argument("--route", choices=ROUTES, default="roundrobin",
                        help="how instances are picked (default: %(default)s)")
    parser.add_argument("--prefill-timeout", type=float, default=PREFILL_TIMEOUT,
                        metavar="SECONDS", help="a prefill instance that has not answered in "
                        "this long is skipped (default: %(default)s)")
    args = parser.parse_args(list(argv))
    try:
        prefill = parse_urls(args.prefill, "--prefill")
        decode = parse_urls(args.decode, "--decode")
    except ValueError as exc:
        parser.error(str(exc))
    try:
        import httpx  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise SystemExit(f"ucm proxy needs httpx, starlette and uvicorn ({exc}): "
                         "pip install 'ucm[proxy]' (vLLM's server brings them too)") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per upstream request
    print(f"ucm proxy on http://{args.host}:{args.port}: prefill {', '.join(prefill)}; "
          f"decode {', '.join(decode)}", flush=True)
    if not args.prefill_timeout > 0:
        parser.error("--prefill-timeout must be more than 0")
    proxy = Proxy(prefill, decode, args.route, args.prefill_timeout)
    uvicorn.run(proxy.app(), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
