"""Prefill/decode disaggregation through ucm on real vLLM servers: a `ucm serve --kv-role
producer` server (prefill) and a `ucm serve --kv-role consumer` server (decode) on one posix
store, started once for the module. The consumer loads the full blocks of a prompt the
producer computed, answers as a colocated ucm hit does (the producer's own ucm hit of the same
prompt: ucm hit against ucm hit, since a cold prefill takes another numeric path), and stores
nothing; a prompt no producer stored is recomputed after a bounded wait, counted. `ucm proxy`
in front of the pair answers as the consumer does, passes errors through, and falls back to the
consumer alone when the prefill instance is down, hung (stopped with SIGSTOP, then resumed) or
killed (the last test, which kills the producer). Both servers publish vLLM's KV events
(`kv_events_config`, ZMQ): a subscriber sees ucm's BlockStored events for a prompt's full blocks,
with vLLM's block hashes, and `ucm proxy --route prefix` sends a prompt to the prefill instance
that stored it. Two engine starts for the whole module."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("vllm")

from serving_support import (
    BLOCK,
    Server,
    block_files,
    free_port,
    metric_sum,
    stream,
    token_ids,
    wait_stored,
    words,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    """(producer, consumer, store): two servers on one posix store, started together, each
    publishing its KV events on a ZMQ endpoint of its own (`server.events`)."""
    root = tmp_path_factory.mktemp("disagg")
    store = root / "store"
    config = {"tiers": [{"driver": "posix", "path": str(store)}]}
    servers = []
    for role in ("producer", "consumer"):
        (root / role).mkdir()
        port = free_port()
        events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                             "endpoint": f"tcp://*:{port}"})  # binds; subscribers connect
        server = Server(tiny_model, root / role, config, name=role,
                        extra=["--kv-role", role, "--kv-events-config", events])
        server.events = f"tcp://127.0.0.1:{port}"
        servers.append(server)
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)
        for server in servers:
            server.wait_ready()
        yield servers[0], servers[1], store


def settled(server: Server, name: str, at_least: float, tries: int = 40, **labels: str,
            ) -> dict:
    """/metrics once `name{labels}` has reached `at_least` (connector stats reach vLLM with
    a later step: a short request with no full block is sent between reads)."""
    samples = server.metrics()
    for _ in range(tries):
        if metric_sum(samples, name, **labels) >= at_least:
            break
        time.sleep(0.25)
        stream(server.client, server.model, "completion", words(12, 77))
        samples = server.metrics()
    return samples


def stored_blocks(samples: dict) -> float:
    return metric_sum(samples, "ucm_connector_blocks_total", op="store")


def test_the_consumer_loads_what_the_producer_stored_and_stores_nothing(pair):
    producer, consumer, store = pair
    doc = words(400, 41)
    cold = stream(producer.client, producer.model, "completion", doc)
    full = (cold["prompt_tokens"] - 1) // BLOCK
    assert full >= 10
    assert wait_stored(store, full) >= full
    colocated = stream(producer.client, producer.model, "completion", doc)  # a ucm hit
    assert colocated["cached"] == full * BLOCK
    files = len(block_files(store))
    before = consumer.metrics()
    decoded = stream(consumer.client, consumer.model, "completion", doc)
    assert decoded["cached"] == full * BLOCK
    assert decoded["tokens"] == colocated["tokens"]
    assert decoded["text"] == colocated["text"]
    loaded = "ucm_connector_blocks_total"
    after = settled(consumer, loaded, metric_sum(before, loaded, op="load", result="ok") + full,
                    op="load", result="ok")
    assert metric_sum(after, loaded, op="load", result="ok") - \
        metric_sum(before, loaded, op="load", result="ok") == full
    assert stored_blocks(after) == 0
    assert wait_stored(store, files) == files  # the consumer wrote no block file
    # The producer stored the prompt's blocks (and those its answers filled).
    assert stored_blocks(settled(producer, loaded, full, op="store", result="ok")) >= full


def test_a_prompt_no_producer_stored_is_recomputed_after_a_bounded_wait(pair):
    _producer, consumer, store = pair
    doc = words(300, 42)
    files = len(block_files(store))
    before = consumer.metrics()
    out = stream(consumer.client, consumer.model, "completion", doc)  # waits consumer_wait
    full = (out["prompt_tokens"] - 1) // BLOCK
    assert out["cached"] == 0 and len(out["tokens"]) == 8
    waits = "ucm_connector_consumer_waits_total"
    after = settled(consumer, waits, metric_sum(before, waits, outcome="expired") + 1,
                    outcome="expired")
    assert metric_sum(after, waits, outcome="expired") - \
        metric_sum(before, waits, outcome="expired") == 1
    missing = "ucm_connector_consumer_missing_blocks_total"
    assert metric_sum(after, missing) - metric_sum(before, missing) == full
    assert stored_blocks(after) == 0 and len(block_files(store)) == files


class Proxy:
    """`ucm proxy` in a process of its own."""

    def __init__(self, root: Path, name: str, prefill: str | None, decode: str | None,
                 extra: tuple[str, ...] = ()) -> None:
        """No `prefill` and `decode`: `extra` names the instances (--instances)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        roles = ["--prefill", prefill, "--decode", decode] if prefill and decode else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ucm.cli", "proxy", *roles, "--port", str(self.port),
             *extra], stdout=self._log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.stop()
                    raise RuntimeError(f"ucm proxy did not start:\n"
                                       f"{self.log_path.read_text()}") from None
                time.sleep(0.2)

    def post(self, path: str, body: dict) -> tuple[int, dict, dict]:
        """Status, headers and JSON answer of a POST to the proxy."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as resp:
                return resp.status, dict(resp.headers), json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), json.loads(err.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def proxies(pair, tmp_path_factory):
    """(proxy, proxy whose one prefill instance is down) in front of the pair's consumer."""
    producer, consumer, _store = pair
    root = tmp_path_factory.mktemp("proxy")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    front = Proxy(root, "proxy", f"http://127.0.0.1:{producer.port}",
                  f"http://127.0.0.1:{consumer.port}")
    try:
        lone = Proxy(root, "proxy-dead-prefill", dead, f"http://127.0.0.1:{consumer.port}")
    except BaseException:
        front.stop()
        raise
    yield front, lone
    front.stop()
    lone.stop()


def ask(client, model: str, kind: str, content: str, *, streamed: bool) -> dict:
    """One greedy request, streamed or not: its text, token ids and cached prompt tokens."""
    if streamed:
        return stream(client, model, kind, content)
    common = {"model": model, "max_tokens": 8, "temperature": 0,
              "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    if kind == "chat":
        out = client.chat.completions.create(
            messages=[{"role": "system", "content": content},
                      {"role": "user", "content": "summarize"}], logprobs=True, **common)
        choice = out.choices[0]
        text, tokens = choice.message.content or "", [t.token for t in choice.logprobs.content]
    else:
        out = client.completions.create(prompt=content, logprobs=0, **common)
        choice = out.choices[0]
        text, tokens = choice.text, list(choice.logprobs.tokens)
    details = out.usage.prompt_tokens_details
    return {"text": text, "tokens": tokens, "prompt_tokens": out.usage.prompt_tokens,
            "cached": int(details.cached_tokens or 0) if details is not None else 0}


@pytest.mark.parametrize("kind,streamed", [("completion", False), ("completion", True),
                                           ("chat", False), ("chat", True)])
def test_the_proxy_answers_as_the_consumer_from_blocks_the_producer_stored(
        pair, proxies, kind, streamed):
    import openai

    _producer, consumer, _store = pair
    front, _lone = proxies
    doc = words(350, 50 + 2 * ["completion", "chat"].index(kind) + streamed)
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="none", timeout=300)
    loaded = "ucm_connector_blocks_total"
    before = consumer.metrics()
    proxied = ask(client, consumer.model, kind, doc, streamed=streamed)
    full = (proxied["prompt_tokens"] - 1) // BLOCK
    assert full >= 8 and len(proxied["tokens"]) == 8
    assert proxied["cached"] == full * BLOCK  # the consumer loaded every full block from ucm
    direct = ask(consumer.client, consumer.model, kind, doc, streamed=streamed)  # a ucm hit
    assert direct["cached"] == full * BLOCK
    assert proxied["tokens"] == direct["tokens"] and proxied["text"] == direct["text"]
    ok = metric_sum(before, loaded, op="load", result="ok")
    after = settled(consumer, loaded, ok + 2 * full, op="load", result="ok")
    assert metric_sum(after, loaded, op="load", result="ok") - ok == 2 * full
    assert stored_blocks(after) == 0


def test_the_proxy_names_the_instances_it_used(pair, proxies):
    producer, consumer, _store = pair
    front, _lone = proxies
    status, headers, answer = front.post("/v1/completions", {
        "model": consumer.model, "prompt": words(100, 60), "max_tokens": 2,
        "temperature": 0})
    assert status == 200 and answer["choices"][0]["text"] is not None
    marks = {k.lower(): v for k, v in headers.items()}
    assert marks["x-ucm-prefill"] == f"http://127.0.0.1:{producer.port}"
    assert marks["x-ucm-decode"] == f"http://127.0.0.1:{consumer.port}"


def test_an_upstream_error_passes_through_with_its_status(pair, proxies):
    _producer, consumer, _store = pair
    front, _lone = proxies
    statuses = []
    for path, body in [
            ("/v1/completions", {"model": "no-such-model", "prompt": "hello"}),  # prefill's
            ("/v1/completions", {"model": consumer.model, "prompt": "hello",
                                 "max_tokens": -3}),  # the decode instance's (prefill: 1)
            ("/v1/chat/completions", {"model": consumer.model, "messages": "not a list"})]:
        status, _headers, answer = front.post(path, body)
        request = urllib.request.Request(
            f"http://127.0.0.1:{consumer.port}{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as direct:
            urllib.request.urlopen(request, timeout=60)
        assert status == direct.value.code, (status, answer)
        assert answer == json.loads(direct.value.read())
        statuses.append(status)
    assert all(400 <= s < 500 for s in statuses), statuses


def test_a_dead_prefill_instance_falls_back_to_the_decode_instance(pair, proxies):
    _producer, consumer, store = pair
    _front, lone = proxies
    waits = "ucm_connector_consumer_waits_total"
    before = consumer.metrics()
    files = len(block_files(store))
    status, headers, answer = lone.post("/v1/completions", {
        "model": consumer.model, "prompt": words(300, 61), "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    assert {k.lower(): v for k, v in headers.items()}["x-ucm-prefill"] == "unavailable"
    expired = metric_sum(before, waits, outcome="expired")
    after = settled(consumer, waits, expired + 1, outcome="expired")
    assert metric_sum(after, waits, outcome="expired") - expired == 1  # recomputed, counted
    assert len(block_files(store)) == files
    with urllib.request.urlopen(lone.url + "/health", timeout=10) as resp:
        assert json.loads(resp.read())["prefill_unavailable"] == 1


def _proxied(front: Proxy, consumer: Server, prompt: str) -> tuple[int, dict, dict]:
    status, headers, answer = front.post("/v1/completions", {
        "model": consumer.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    return status, {k.lower(): v for k, v in headers.items()}, answer


def test_a_hung_prefill_instance_is_given_up_after_the_prefill_timeout(pair, tmp_path):
    producer, consumer, _store = pair
    hung = Proxy(tmp_path, "proxy-hung-prefill", f"http://127.0.0.1:{producer.port}",
                 f"http://127.0.0.1:{consumer.port}", extra=("--prefill-timeout", "3"))
    waits = "ucm_connector_consumer_waits_total"
    before = consumer.metrics()
    os.killpg(producer.proc.pid, signal.SIGSTOP)  # it accepts connections, answers nothing
    try:
        status, headers, answer = _proxied(hung, consumer, words(300, 62))
    finally:
        os.killpg(producer.proc.pid, signal.SIGCONT)
        with urllib.request.urlopen(hung.url + "/health", timeout=10) as resp:
            health = json.loads(resp.read())
        hung.stop()
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    assert headers["x-ucm-prefill"] == "unavailable"
    assert health["prefill_timeouts"] == 1 and health["prefill_unavailable"] == 1
    expired = metric_sum(before, waits, outcome="expired")
    after = settled(consumer, waits, expired + 1, outcome="expired")
    assert metric_sum(after, waits, outcome="expired") - expired == 1


def tokenize(server: Server, text: str) -> list[int]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/tokenize", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": server.model, "prompt": text}).encode())
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())["tokens"]


def test_the_producer_publishes_the_blocks_ucm_stored_as_kv_events(pair):
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    producer, _consumer, _store = pair
    doc = words(250, 70)
    tokens = tokenize(producer, doc)
    full = (len(tokens) - 1) // BLOCK
    assert full >= 6
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(producer.events)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    stored: list[BlockStored] = []
    try:
        time.sleep(0.5)  # a SUB socket misses what is published before it has joined
        out = stream(producer.client, producer.model, "completion", doc)
        # the prompt's and the generated tokens' full blocks (the last token's KV is not
        # computed): save_generated stores both
        seq = tokens + token_ids(out)
        n = (len(seq) - 1) // BLOCK
        # vLLM's own block hashes (sha256, its fixed seed; published as 64-bit ints by default),
        # each chained onto the one before
        hash_fn = get_hash_fn_by_name("sha256")
        kv_cache_utils.init_none_hash(hash_fn)
        parent, expected = kv_cache_utils.NONE_HASH, []
        for i in range(n):
            block = seq[i * BLOCK:(i + 1) * BLOCK]
            parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, block)
            expected.append(kv_cache_utils.maybe_convert_block_hash(parent))  # as vLLM publishes
        for _ in range(40):  # events ride on later steps: a short request between reads
            while sub.poll(250):
                _topic, _seq, payload = sub.recv_multipart()
                stored += [e for e in decoder.decode(payload).events
                           if isinstance(e, BlockStored) and e.medium == "ucm:posix"]
            if sum(len(e.block_hashes) for e in stored if e.block_hashes[0] in expected) >= n:
                break
            stream(producer.client, producer.model, "completion", words(12, 71))
    finally:
        sub.close()
    stored = [e for e in stored if e.block_hashes[0] in expected]  # not the short requests'
    assert n >= full and [h for e in stored for h in e.block_hashes] == expected
    assert [t for e in stored for t in e.token_ids] == seq[:n * BLOCK]
    assert all(e.block_size == BLOCK for e in stored)
    assert stored[0].parent_block_hash is None
    for before, event in itertools.pairwise(stored):
        assert event.parent_block_hash == before.block_hashes[-1]


def proxy_health(front: Proxy) -> dict:
    with urllib.request.urlopen(front.url + "/health", timeout=30) as resp:
        return dict(json.loads(resp.read()))


def stored_and_indexed(front: Proxy, producer: Server, seed: int) -> tuple[str, dict]:
    """A document the producer answers (its greedy answer) and stores, once the proxy's
    prefix index holds all its full blocks (the producer's later steps publish the events)."""
    time.sleep(0.5)  # the proxy's subscriptions join before the producer publishes
    doc = words(250, seed)
    full = (len(tokenize(producer, doc)) - 1) // BLOCK
    direct = stream(producer.client, producer.model, "completion", doc)
    for _ in range(40):
        health = proxy_health(front)
        if health["index"].get("stored_blocks", 0) >= full:
            break
        stream(producer.client, producer.model, "completion", words(12, seed + 1))
    assert health["index"]["stored_blocks"] >= full
    return doc, direct


def test_route_prefix_sends_a_prompt_to_the_prefill_instance_that_stored_it(
        pair, tmp_path_factory):
    producer, consumer, _store = pair
    root = tmp_path_factory.mktemp("proxy-prefix")
    urls = [f"http://127.0.0.1:{s.port}" for s in (consumer, producer)]
    front = Proxy(root, "proxy-prefix", ",".join(urls), urls[0],
                  extra=("--route", "prefix", "--kv-events",
                         f"{consumer.events},{producer.events}"))
    try:
        doc, _direct = stored_and_indexed(front, producer, seed=72)
        chosen = []
        for _ in range(3):  # in turn, two of three would start at the consumer
            status, headers, _answer = front.post("/v1/completions", {
                "model": consumer.model, "prompt": doc, "max_tokens": 2, "temperature": 0})
            assert status == 200
            chosen.append({k.lower(): v for k, v in headers.items()}["x-ucm-prefill"])
        assert chosen == [urls[1]] * 3
        health = proxy_health(front)
        assert health["routed_by_prefix"] >= 1 and health["tokenize_failed"] == 0
    finally:
        front.stop()


def test_instances_that_do_both_get_whole_requests_routed_by_prefix(pair, tmp_path_factory):
    """`ucm proxy --instances`: no split; each request goes whole to the instance holding
    the longest prefix (the producer stored it), and its answer is that instance's own."""
    producer, consumer, _store = pair
    root = tmp_path_factory.mktemp("proxy-instances")
    urls = [f"http://127.0.0.1:{s.port}" for s in (consumer, producer)]
    front = Proxy(root, "proxy-instances", None, None, extra=(
        "--instances", ",".join(urls), "--route", "prefix", "--kv-events",
        f"{consumer.events},{producer.events}"))
    try:
        doc, direct = stored_and_indexed(front, producer, seed=81)
        for _ in range(2):  # in turn, one of two would go to the consumer
            status, headers, answer = front.post("/v1/completions", {
                "model": producer.model, "prompt": doc, "max_tokens": 8, "temperature": 0,
                "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True})
            marks = {k.lower(): v for k, v in headers.items()}
            assert status == 200 and marks["x-ucm-instance"] == urls[1]
            assert "x-ucm-prefill" not in marks and "x-ucm-decode" not in marks
            assert answer["choices"][0]["logprobs"]["tokens"] == direct["tokens"]
        health = proxy_health(front)
        assert health["instances"] == urls and health["routed_by_prefix"] >= 1
        assert health["instance_unavailable"] == 0
    finally:
        front.stop()


def test_a_killed_prefill_instance_leaves_the_decode_instance_to_recompute(pair, proxies):
    """Kills the module's producer: defined last, so it runs last in the module."""
    producer, consumer, store = pair
    front, _lone = proxies
    os.killpg(producer.proc.pid, signal.SIGKILL)
    producer.proc.wait()
    waits, missing = ("ucm_connector_consumer_waits_total",
                      "ucm_connector_consumer_missing_blocks_total")
    before = consumer.metrics()
    files = len(block_files(store))
    prompt = words(300, 63)
    status, headers, proxied = _proxied(front, consumer, prompt)
    assert status == 200 and headers["x-ucm-prefill"] == "unavailable", proxied
    full = (proxied["usage"]["prompt_tokens"] - 1) // BLOCK
    # The same request straight to the consumer: recomputed the same way, after the same wait
    request = urllib.request.Request(
        f"http://127.0.0.1:{consumer.port}/v1/completions", headers={
            "Content-Type": "application/json"}, data=json.dumps({
                "model": consumer.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
            }).encode())
    with urllib.request.urlopen(request, timeout=300) as resp:
        direct = json.loads(resp.read())
    assert proxied["choices"][0]["logprobs"]["tokens"] == \
        direct["choices"][0]["logprobs"]["tokens"]
    expired = metric_sum(before, waits, outcome="expired")
    after = settled(consumer, waits, expired + 2, outcome="expired")
    assert metric_sum(after, waits, outcome="expired") - expired == 2
    assert metric_sum(after, missing) - metric_sum(before, missing) == 2 * full
    assert len(block_files(store)) == files

