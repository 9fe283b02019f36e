"""`ucm proxy`'s parts that need no engine: instance URLs, the order instances are tried in,
the request a prefill instance gets, the command's refusals, and route prefix's index fed
with event batches as vLLM encodes and publishes them (its msgspec structs, its ZMQ
publisher). The proxy itself runs against real vLLM servers in tests/vllm/test_disagg.py."""

from __future__ import annotations

import asyncio
import socket

import pytest

from ucm.proxy import DEFAULT_HOST, Proxy, RoundRobin, main, parse_urls, prefill_body
from ucm.proxy.index import PrefixIndex, chain_keys, parse_endpoints, tokenize_body


def test_instance_urls():
    assert parse_urls("http://127.0.0.1:8100/, https://h:1", "--prefill") == [
        "http://127.0.0.1:8100", "https://h:1"]
    for bad in ("", " , ", "127.0.0.1:8100", "ftp://h:1", "http://"):
        with pytest.raises(ValueError, match="--decode"):
            parse_urls(bad, "--decode")


def test_round_robin_starts_one_further_each_time_and_keeps_the_rest_as_fallbacks():
    rr = RoundRobin(["a", "b", "c"])
    assert [rr.order() for _ in range(4)] == [["a", "b", "c"], ["b", "c", "a"],
                                              ["c", "a", "b"], ["a", "b", "c"]]


def test_a_prefill_instance_computes_the_prompt_and_one_token_unstreamed():
    body = {"model": "m", "prompt": "p", "max_tokens": 64, "stream": True, "n": 3,
            "stream_options": {"include_usage": True}, "min_tokens": 8, "temperature": 0}
    assert prefill_body(body) == {"model": "m", "prompt": "p", "max_tokens": 1,
                                  "stream": False, "n": 1, "min_tokens": 0, "temperature": 0}
    assert body["max_tokens"] == 64 and body["stream"]  # the decode instance's is untouched
    chat = prefill_body({"messages": [], "max_completion_tokens": 50})
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1


def test_the_command_refuses_what_it_cannot_do(capsys):
    with pytest.raises(SystemExit):
        main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
              "--route", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--prefill", "http://127.0.0.1:1,http://127.0.0.1:3", "--decode",
              "http://127.0.0.1:2", "--route", "prefix", "--kv-events", "tcp://127.0.0.1:5"])
    assert "one endpoint per --prefill instance" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
              "--route", "prefix"])
    assert "(1 instances, 0 endpoints)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
              "--kv-events", "tcp://127.0.0.1:5"])
    assert "--kv-events is for --route prefix only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
              "--route", "prefix", "--kv-events", "tcp://*:5557"])
    assert "'tcp://*:5557' is not a tcp://HOST:PORT" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one KV-events endpoint per prefill instance"):
        Proxy(["http://a"], ["http://b"], route="prefix")
    with pytest.raises(ValueError, match="route prefix only"):
        Proxy(["http://a"], ["http://b"], kv_events=["tcp://h:1"])
    with pytest.raises(SystemExit):
        main(["--prefill", "localhost:1", "--decode", "http://127.0.0.1:2"])
    assert "is not an http(s)://HOST[:PORT] URL" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
              "--prefill-timeout", "0"])
    assert "--prefill-timeout must be more than 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="route"):
        Proxy(["http://a"], ["http://b"], route="random")
    with pytest.raises(ValueError, match="prefill_timeout"):
        Proxy(["http://a"], ["http://b"], prefill_timeout=-1)
    assert DEFAULT_HOST == "127.0.0.1"


def test_kv_events_endpoints():
    assert parse_endpoints("tcp://10.0.0.2:5557, ipc:///tmp/ev", "--kv-events") == [
        "tcp://10.0.0.2:5557", "ipc:///tmp/ev"]
    for bad in ("", "tcp://h", "http://h:1", "tcp://*:5557", "tcp://h:port"):
        with pytest.raises(ValueError, match="--kv-events"):
            parse_endpoints(bad, "--kv-events")


# -- route prefix: the index, fed with vLLM's own event structs, encoded as vLLM encodes them --

BS = 4


def _batch(*events) -> bytes:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=list(events)))


def _stored(hashes, parent, tokens, medium, lora_name=None):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium=medium, lora_name=lora_name)


def _removed(hashes, medium):
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=hashes, medium=medium)


PROMPT = list(range(100, 114))  # 3 full blocks and 2 tokens


def test_the_index_keys_blocks_by_their_tokens_not_by_an_instances_hashes():
    pytest.importorskip("vllm")
    index = PrefixIndex(["a", "b"])
    # Two instances, two hash seeds: the same tokens under different hashes
    index.apply("a", _batch(_stored([b"a1", b"a2"], None, PROMPT[:8], "ucm:posix")))
    index.apply("b", _batch(_stored([11, 12, 13], None, PROMPT[:12], "ucm:posix")))
    assert index.score("a", PROMPT)[-1] == 2 and index.score("b", PROMPT)[-1] == 3
    assert index.order(PROMPT, ["a", "b"]) == ["b", "a"]
    # A block chained onto a parent event, one at a time as ucm publishes each completion
    index.apply("a", _batch(_stored([b"a3"], b"a2", PROMPT[8:12], "ucm:posix")))
    assert index.score("a", PROMPT)[-1] == 3
    assert index.order(PROMPT, ["a", "b"]) == ["a", "b"]  # equal: in turn
    assert index.order(PROMPT, ["b", "a"]) == ["b", "a"]
    assert chain_keys(PROMPT, BS)[:2] == chain_keys(PROMPT[:8], BS)
    other = [7, *PROMPT[1:]]  # the first token differs: no block of it is held
    assert index.score("a", other)[-1] == 0
    assert index.statistics()["stored_blocks"] == 6


def test_the_fastest_tier_holding_the_longest_prefix_wins():
    pytest.importorskip("vllm")
    index = PrefixIndex(["a", "b", "c"])
    index.apply("a", _batch(_stored([1, 2, 3], None, PROMPT[:12], "ucm:posix")))
    index.apply("b", _batch(_stored([1, 2], None, PROMPT[:8], "ucm:posix"),
                            _stored([1, 2], None, PROMPT[:8], "ucm:memory")))
    # b holds 2 blocks in memory, a 3 on posix: b's memory tier serves the longer fast prefix
    assert index.order(PROMPT, ["a", "b", "c"]) == ["b", "a", "c"]
    # b's memory tier evicts the second block: b 1 in memory (2 on posix), still ahead of a
    index.apply("b", _batch(_removed([2], "ucm:memory")))
    assert index.score("b", PROMPT)[2] == 1  # ucm:memory is MEDIA[2]
    assert index.order(PROMPT, ["a", "b", "c"]) == ["b", "a", "c"]
    # then every tier of b lost its first block: nothing of the prompt is b's any more
    index.apply("b", _batch(_removed([1], "ucm:memory"), _removed([1], "ucm:posix")))
    assert index.score("b", PROMPT)[-1] == 0
    assert index.order(PROMPT, ["b", "c", "a"]) == ["a", "b", "c"]
    # vLLM's own prefix cache is faster still; clearing it leaves ucm's blocks
    index.apply("c", _batch(_stored([9], None, PROMPT[:4], "GPU")))
    assert index.order(PROMPT, ["a", "b", "c"])[0] == "c"
    from vllm.distributed.kv_events import AllBlocksCleared

    index.apply("c", _batch(AllBlocksCleared()))
    assert index.score("c", PROMPT)[-1] == 0
    assert index.order(PROMPT, ["a", "b", "c"])[0] == "a"


def test_what_the_index_cannot_place_is_counted_not_guessed():
    pytest.importorskip("vllm")
    index = PrefixIndex(["a"])
    index.apply("a", _batch(_stored([5], b"unknown parent", PROMPT[4:8], "ucm:posix")))
    index.apply("a", b"\xc1 not msgpack")
    index.apply("a", _batch(_stored([6, 7], None, PROMPT[:4], "ucm:posix")))  # 2 blocks, 1 full
    stats = index.statistics()
    assert stats["orphan_blocks"] == 1 and stats["undecodable_batches"] == 1
    assert stats["undecodable_events"] == 1 and stats["blocks"] == 0
    assert index.order(PROMPT, ["a"]) == ["a"] and index.order(None, ["a"]) == ["a"]
    # LoRA chains are apart from the base model's
    index.apply("a", _batch(_stored([8], None, PROMPT[:4], "ucm:posix", lora_name="l1")))
    assert index.score("a", PROMPT)[-1] == 0
    assert index.score("a", PROMPT, "l1")[-1] == 1


def test_the_index_forgets_the_oldest_blocks_beyond_its_bound():
    pytest.importorskip("vllm")
    index = PrefixIndex(["a"], max_blocks=2)
    index.apply("a", _batch(_stored([1, 2], None, PROMPT[:8], "ucm:posix")))
    index.apply("a", _batch(_stored([3], 2, PROMPT[8:12], "ucm:posix")))
    assert index.statistics()["forgotten_blocks"] == 1 and index.statistics()["blocks"] == 2
    assert index.score("a", PROMPT)[-1] == 0  # its first block is forgotten: no prefix
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixIndex(["a"], max_blocks=0)


def test_the_prompt_is_tokenized_as_the_instance_would():
    assert tokenize_body("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3,
                                             "add_special_tokens": False}) == {
        "model": "m", "prompt": "hi", "add_special_tokens": False}
    assert tokenize_body("/v1/completions", {"prompt": ["a", "b"]}) is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "add_generation_prompt": False}
    assert tokenize_body("/v1/chat/completions", chat) == {
        "model": "m", "messages": chat["messages"], "add_generation_prompt": False}


def test_a_gap_in_the_sequence_is_counted_and_a_restarted_instance_forgotten():
    pytest.importorskip("vllm")
    proxy = Proxy(["http://a", "http://b"], ["http://d"], route="prefix",
                  kv_events=["tcp://h:1", "tcp://h:2"])

    def frames(seq: int, *events) -> list[bytes]:  # as vLLM's ZmqEventPublisher sends them
        return [b"", seq.to_bytes(8, "big"), _batch(*events)]

    proxy.received("http://a", frames(0, _stored([1], None, PROMPT[:4], "ucm:memory")))
    proxy.received("http://a", frames(3, _stored([2], 1, PROMPT[4:8], "ucm:memory")))
    assert proxy.counts["events_missed"] == 2
    assert proxy.index.score("http://a", PROMPT)[-1] == 2
    proxy.received("http://a", frames(0))  # its publisher starts again: a new process
    assert proxy.counts["instance_restarts"] == 1
    assert proxy.index.score("http://a", PROMPT)[-1] == 0
    proxy.received("http://a", [b"only one frame"])
    assert proxy.index.counts["undecodable_batches"] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_proxy_subscribes_to_vllms_zmq_publisher():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")  # binds, as an engine does
    proxy = Proxy(["http://a", "http://b"], ["http://d"], route="prefix",
                  kv_events=[endpoint, f"tcp://127.0.0.1:{_free_port()}"])

    async def run() -> int:
        task = asyncio.ensure_future(proxy.subscribe("http://a", endpoint))
        sent = 0
        try:
            for _ in range(200):  # a SUB socket misses what is sent before it has joined
                publisher.publish(KVEventBatch(ts=1.0, events=[
                    _stored([sent], None, PROMPT[:4], "ucm:posix")]))
                sent += 1
                await asyncio.sleep(0.05)
                if proxy.index.statistics().get("stored_blocks"):
                    break
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return sent

    try:
        sent = asyncio.run(run())
    finally:
        publisher.shutdown()
    assert proxy.index.statistics()["batches"] >= 1
    assert proxy.index.order(PROMPT, ["http://b", "http://a"]) == ["http://a", "http://b"]
    assert proxy.counts["events_missed"] == 0 and sent < 200
