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


def _kv_transfer(argv: list[str]) -> dict:
    import json

    args = server_argv(argv)
    return json.loads(args[args.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("role,kv_role", [(None, "kv_both"), ("both", "kv_both"),
                                          ("producer", "kv_producer"),
                                          ("consumer", "kv_consumer")])
def test_kv_role_names_vllms_role_for_the_connector(role, kv_role):
    for argv in ([["M"]] if role is None else [["M", "--kv-role", role],
                                                ["M", f"--kv-role={role}", "--port", "1"]]):
        kvt = _kv_transfer(argv)
        assert kvt["kv_role"] == kv_role and kvt["kv_connector"] == "UCMConnector"
        assert "--kv-role" not in " ".join(server_argv(argv))  # vLLM has no such option


def test_a_bad_kv_role_or_a_role_with_a_whole_config_is_refused():
    with pytest.raises(SystemExit, match="--kv-role must be one of both, producer, consumer"):
        server_argv(["M", "--kv-role", "decode"])
    with pytest.raises(SystemExit, match="--kv-transfer-config"):
        server_argv(["M", "--kv-role", "consumer", "--kv-transfer-config", "{}"])
    with pytest.raises(SystemExit, match="needs a value"):
        server_argv(["M", "--kv-role"])
