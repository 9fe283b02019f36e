"""`ucm serve` listens on loopback unless the user names a host: vLLM's own default binds
every interface, and its OpenAI API and /metrics take no key unless `--api-key` is given.
Only the argument list is built here (no engine starts)."""

from __future__ import annotations

import pytest

from ucm.vllm_hook.serve import server_argv


def _host(argv: list[str]) -> list[str]:
    """The values of every --host in `argv` (both spellings)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--host":
            out.append(argv[i + 1])
        elif arg.startswith("--host="):
            out.append(arg.split("=", 1)[1])
    return out


@pytest.mark.parametrize("argv", [["M"], ["--model", "M", "--port", "8001"],
                                  ["M", "--ucm-config", "u.yaml"],
                                  ["M", "--kv-transfer-config", "{}"],
                                  ["M", "--api-key", "secret"]])
def test_serve_binds_loopback_by_default(argv):
    assert _host(server_argv(argv)) == ["127.0.0.1"]


@pytest.mark.parametrize("argv", [["M", "--host", "0.0.0.0"], ["M", "--host=::"],
                                  ["--host", "10.0.0.5", "--model", "M"]])
def test_a_host_the_user_names_is_kept_alone(argv):
    args = server_argv(argv)
    assert _host(args) == _host(argv)
    assert args.count("--host") + sum(a.startswith("--host=") for a in args) == 1


def test_a_unix_socket_gets_no_host():
    for argv in (["M", "--uds", "/run/ucm.sock"], ["M", "--uds=/run/ucm.sock"]):
        assert _host(server_argv(argv)) == []
