"""Prefill/decode disaggregation through ucm on real vLLM servers: a `ucm serve --kv-role
producer` server (prefill) and a `ucm serve --kv-role consumer` server (decode) on one posix
store, started once for the module. The consumer loads the full blocks of a prompt the
producer computed, answers as a colocated ucm hit does (the producer's own ucm hit of the same
prompt: ucm hit against ucm hit, since a cold prefill takes another numeric path), and stores
nothing; a prompt no producer stored is recomputed after a bounded wait, counted. `ucm proxy`
in front of the pair answers as the consumer does. Two engine starts for the whole module."""

from __future__ import annotations

import contextlib
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("vllm")

from serving_support import (
    BLOCK,
    Server,
    block_files,
    metric_sum,
    stream,
    wait_stored,
    words,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    """(producer, consumer, store): two servers on one posix store, started together."""
    root = tmp_path_factory.mktemp("disagg")
    store = root / "store"
    config = {"tiers": [{"driver": "posix", "path": str(store)}]}
    servers = []
    for role in ("producer", "consumer"):
        (root / role).mkdir()
        servers.append(Server(tiny_model, root / role, config, name=role,
                              extra=["--kv-role", role]))
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
