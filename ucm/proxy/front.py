"""The proxy itself (the package's docstring says what it does): its instances, the
requests it forwards, its errors, and the `ucm proxy` command line."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ucm.proxy.index import PrefixIndex, parse_endpoints, prompt_tokens, tokenize_body

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger("ucm.proxy")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
ROUTES = ("roundrobin", "prefix")
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
                 route: str = "roundrobin", prefill_timeout: float = PREFILL_TIMEOUT,
                 kv_events: Sequence[str] = ()) -> None:
        """`kv_events`: with route "prefix", each prefill instance's KV-events endpoint, in
        the order of `prefill`. No `decode` instances: the `prefill` ones do both (each
        request goes whole to one of them)."""
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, not {route!r}")
        if not prefill_timeout > 0:
            raise ValueError(f"prefill_timeout must be more than 0 s, not {prefill_timeout}")
        if route == "prefix" and len(kv_events) != len(prefill):
            raise ValueError(f"route prefix needs one KV-events endpoint per prefill instance, "
                             f"in their order: {len(prefill)} instances, "
                             f"{len(kv_events)} endpoints")
        if route != "prefix" and kv_events:
            raise ValueError("KV-events endpoints are for route prefix only")
        self.route = route
        self.prefill_timeout = prefill_timeout
        self.prefill, self.decode = RoundRobin(prefill), RoundRobin(decode)
        self.colocated = not decode
        self.kv_events = dict(zip(prefill, kv_events, strict=True)) if kv_events else {}
        self.index = PrefixIndex(prefill)
        self.client: httpx.AsyncClient | None = None
        self.counts: dict[str, int] = (
            {"requests": 0, "instance_unavailable": 0, "upstream_errors": 0} if not decode else
            {"requests": 0, "prefill_unavailable": 0, "prefill_timeouts": 0,
             "decode_unavailable": 0, "upstream_errors": 0})
        if route == "prefix":
            self.counts.update(routed_by_prefix=0, routed_in_turn=0, tokenize_failed=0,
                               events_missed=0, instance_restarts=0)
        self._last_seq: dict[str, int] = {}

    def received(self, instance: str, frames: Sequence[bytes]) -> None:
        """One message of `instance`'s publisher (vLLM's ZMQ publisher: topic, sequence
        number, msgpack KVEventBatch) into the index. A gap in the sequence is counted (those
        blocks are unknown until stored again); a sequence that starts again is a restarted
        instance, whose blocks are forgotten (its memory tiers are empty now)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.index.counts["undecodable_batches"] += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = self._last_seq.get(instance)
        if last is not None and seq <= last:
            self.counts["instance_restarts"] += 1
            self.index.forget(instance)
        elif last is not None and seq > last + 1:
            self.counts["events_missed"] += seq - last - 1
        self._last_seq[instance] = seq
        self.index.apply(instance, frames[2])

    async def subscribe(self, instance: str, endpoint: str) -> None:
        """Feeds `instance`'s KV events into the index (`received`) until cancelled."""
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            while True:
                self.received(instance, await sock.recv_multipart())
        finally:
            sock.close(linger=0)

    async def _routed(self, path: str, body: dict[str, Any], headers: dict[str, str],
                      ) -> list[str]:
        """The prefill instances to try, in order: by route prefix, the one whose fastest
        tier holds the longest prefix of the prompt first (equal ones in turn)."""
        turn = self.prefill.order()
        if self.route != "prefix":
            return turn
        tokens = prompt_tokens(body) if not path.endswith("/chat/completions") else None
        request = tokenize_body(path, body) if tokens is None else None
        if request is not None:
            tokens = await self._tokenize(turn, request, headers)
        order = self.index.order(tokens, turn)
        routed = tokens is not None and self.index.score(order[0], tokens) > \
            self.index.score(turn[0], tokens)
        self.counts["routed_by_prefix" if routed else "routed_in_turn"] += 1
        return order

    async def _tokenize(self, instances: list[str], request: dict[str, Any],
                        headers: dict[str, str]) -> list[int] | None:
        """The prompt's token ids from an instance's /tokenize; None when none answers."""
        import httpx

        assert self.client is not None
        for url in instances:
            try:
                answer = await self.client.post(url + "/tokenize", json=request,
                                                headers=headers, timeout=CONNECT_TIMEOUT)
            except httpx.TransportError:
                continue
            if answer.status_code == 200:
                tokens = answer.json().get("tokens")
                if isinstance(tokens, list):
                    return [int(t) for t in tokens]
            break  # refused (a bad request): the prefill instance will say so
        self.counts["tokenize_failed"] += 1
        return None

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        import httpx

        timeout = httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=64)) as client:
            self.client = client
            tasks = [asyncio.ensure_future(self.subscribe(i, e))
                     for i, e in self.kv_events.items()]
            for task in tasks:
                task.add_done_callback(_log_failure)
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
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

        extra: dict[str, Any] = {"route": self.route}
        if self.route == "prefix":
            extra["index"] = self.index.statistics()
        instances = ({"instances": self.prefill.urls} if self.colocated else
                     {"prefill": self.prefill.urls, "decode": self.decode.urls})
        return JSONResponse({**instances, **self.counts, **extra})

    async def models(self, request: Request) -> Response:
        import httpx

        assert self.client is not None
        for url in (self.prefill if self.colocated else self.decode).order():
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
        if self.colocated:
            return await self._answer(await self._routed(path, body, headers), "instance",
                                      path, body, headers, {})
        prefilled = "unavailable"
        for url in await self._routed(path, body, headers):
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
        return await self._answer(self.decode.order(), "decode", path, body, headers,
                                  {"x-ucm-prefill": prefilled})

    async def _answer(self, urls: list[str], role: str, path: str, body: dict[str, Any],
                      headers: dict[str, str], marks: dict[str, str]) -> Response:
        """The client's answer from the first of `urls` that can be reached (`role`: decode,
        or instance when instances do both), marked x-ucm-<role>."""
        import httpx
        from starlette.background import BackgroundTask
        from starlette.responses import StreamingResponse

        assert self.client is not None
        for url in urls:
            marks = {**marks, f"x-ucm-{role}": url}
            request = self.client.build_request("POST", url + path, json=body, headers=headers)
            try:
                answer = await self.client.send(request, stream=True)
            except httpx.ConnectError as exc:  # never reached it: the next one may serve
                log.warning("ucm proxy: %s instance %s: %s", role, url, exc)
                continue
            except httpx.TransportError as exc:  # it may have started: not sent twice
                return _error(502, f"ucm proxy: {role} instance {url}: {exc!r}")
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
        self.counts[f"{role}_unavailable"] += 1
        return _error(502, f"ucm proxy: no {role} instance reachable ({', '.join(urls)})")


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("ucm proxy: KV-events subscription failed: %r", task.exception())


def _headers(request: Request) -> dict[str, str]:
    return {k: request.headers[k] for k in _FORWARDED if k in request.headers}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ucm proxy", description="OpenAI-compatible front for prefill/decode "
        "disaggregation: each request is prefilled on a prefill instance (max_tokens 1), "
        "then answered by a decode instance that loads the prompt's KV from ucm")
    parser.add_argument("--prefill", metavar="URL[,URL...]",
                        help="prefill instances (ucm serve --kv-role producer)")
    parser.add_argument("--decode", metavar="URL[,URL...]",
                        help="decode instances (ucm serve --kv-role consumer)")
    parser.add_argument("--instances", metavar="URL[,URL...]",
                        help="instead of --prefill and --decode: instances that do both "
                        "(ucm serve), each request sent whole to one of them")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="address to listen on (default: %(default)s, loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="port to listen on (default: %(default)s)")
    parser.add_argument("--route", choices=ROUTES, default="roundrobin",
                        help="how instances are picked (default: %(default)s)")
    parser.add_argument("--kv-events", metavar="ENDPOINT[,ENDPOINT...]",
                        help="with --route prefix: each prefill instance's KV-events endpoint "
                        "(vLLM's kv_events_config publisher, e.g. tcp://HOST:5557), in the "
                        "order of --prefill (or --instances)")
    parser.add_argument("--prefill-timeout", type=float, default=PREFILL_TIMEOUT,
                        metavar="SECONDS", help="a prefill instance that has not answered in "
                        "this long is skipped (default: %(default)s)")
    args = parser.parse_args(list(argv))
    if args.instances and (args.prefill or args.decode):
        parser.error("--instances replaces --prefill and --decode: give one or the other")
    if not args.instances and not (args.prefill and args.decode):
        parser.error("give --prefill and --decode (disaggregated), or --instances")
    routed = "--instances" if args.instances else "--prefill"
    try:
        if args.instances:
            prefill, decode = parse_urls(args.instances, "--instances"), []
        else:
            prefill = parse_urls(args.prefill, "--prefill")
            decode = parse_urls(args.decode, "--decode")
        kv_events = parse_endpoints(args.kv_events, "--kv-events") if args.kv_events else []
    except ValueError as exc:
        parser.error(str(exc))
    if args.route == "prefix" and len(kv_events) != len(prefill):
        parser.error(f"--route prefix needs --kv-events with one endpoint per {routed} "
                     f"instance, in the same order ({len(prefill)} instances, "
                     f"{len(kv_events)} endpoints)")
    if args.route != "prefix" and kv_events:
        parser.error("--kv-events is for --route prefix only")
    try:
        import httpx  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
        if kv_events:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"ucm proxy needs httpx, starlette, uvicorn (and, for --route "
                         f"prefix, pyzmq and msgspec) ({exc}): "
                         "pip install 'ucm[proxy]' (vLLM's server brings them too)") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per upstream request
    roles = (f"instances {', '.join(prefill)}" if not decode else
             f"prefill {', '.join(prefill)}; decode {', '.join(decode)}")
    print(f"ucm proxy on http://{args.host}:{args.port}: {roles}; route {args.route}",
          flush=True)
    if not args.prefill_timeout > 0:
        parser.error("--prefill-timeout must be more than 0")
    proxy = Proxy(prefill, decode, args.route, args.prefill_timeout, kv_events)
    uvicorn.run(proxy.app(), host=args.host, port=args.port, log_level="warning")
    return 0


