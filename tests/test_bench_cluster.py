"""`ucm bench cluster` without engines: its workloads, argument checks and table."""

from __future__ import annotations

import argparse
import json

import pytest

from ucm.bench.cluster import Run, _print, chat_requests, main, trace_requests


def test_chat_turns_carry_the_whole_conversation_so_far():
    requests = chat_requests(sessions=3, turns=2, doc_tokens=100, vocab=500)
    assert len(requests) == 6
    first, second = requests[:3], requests[3:]  # turn 1 of every session, then turn 2
    for a, b in zip(first, second, strict=True):
        assert len(a) == 100 + 48 and b[:len(a)] == a and len(b) == len(a) + 16 + 48
    assert len({tuple(r[:100]) for r in first}) == 3  # a document per session
    assert all(3 <= t < 500 for r in requests for t in r)


def test_trace_hash_ids_become_shared_token_blocks(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i, "hash_ids": ids}) for i, ids in
                               enumerate([[0, 1], [0, 2, 3], [4]])))
    requests = trace_requests(str(trace), 2, block_tokens=8, vocab=100, max_tokens=20)
    assert [len(r) for r in requests] == [16, 20]  # the second cut to max_tokens
    assert requests[0][:8] == requests[1][:8]  # hash id 0: the same tokens
    assert requests[0][8:] != requests[1][8:16]


@pytest.mark.parametrize(("argv", "message"), [
    (["--instances", "1,x"], "--instances must be counts"),
    (["--instances", "0"], "at least 1"),
    (["--routes", "random"], "--routes"),
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--workload", "mooncake", "--trace", "/nonexistent.jsonl"], "no such file"),
])
def test_bad_arguments_stop_with_the_option_named(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_table_splits_hits_by_where_they_came_from(capsys):
    args = argparse.Namespace(workload="chat", concurrency=2, memory_mib=256)
    run = Run(2, "prefix", ttft=[0.1, 0.2], errors=0, routed_by_prefix=5,
              sources={"local_compute": 200.0, "local_cache_hit": 400.0,
                       "external_kv_transfer": 400.0},
              loaded={"memory": 30.0, "posix": 10.0})
    _print([run], args, [[1] * 500, [2] * 500])
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.split()[:1] == ["2"]).split()
    # 80 % hit; of the hits half vLLM's cache, 3/8 ucm memory, 1/8 the shared posix store
    assert row[:6] == ["2", "prefix", "80%", "50%", "38%", "12%"]
    assert row[-2:] == ["5", "0"]
