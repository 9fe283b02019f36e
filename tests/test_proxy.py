"""`ucm proxy`'s parts that need no engine: instance URLs, the order instances are tried in,
the request a prefill instance gets, and the command's refusals. The proxy itself runs against
real vLLM servers in tests/vllm/test_disagg.py."""

from __future__ import annotations

import pytest

from ucm.proxy import DEFAULT_HOST, Proxy, RoundRobin, main, parse_urls, prefill_body


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
              "--route", "prefix"])
    assert "invalid choice: 'prefix'" in capsys.readouterr().err
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
