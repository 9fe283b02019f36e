"""Helpers for the tests on real SGLang: it lives in .venv-sglang (scripts/sglang/setup.sh),
so these tests drive that venv's python in subprocesses (support/run_engine.py) and skip, saying
why, where it is not installed."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SGLANG_VENV = Path(os.environ.get("UCM_SGLANG_VENV", ROOT / ".venv-sglang"))
SGLANG_PY = SGLANG_VENV / "bin" / "python"
STAMP = SGLANG_VENV / ".ucm-sglang-installed"
RUNNER = Path(__file__).parent / "support" / "run_engine.py"
PAGE_SIZE = 16


def sglang_missing() -> str | None:
    if not STAMP.exists():
        return (f"SGLang is not installed in {SGLANG_VENV} (scripts/sglang/setup.sh builds it; "
                f"scripts/test.sh runs it and goes on without it when it fails)")
    return None


needs_sglang = pytest.mark.skipif(sglang_missing() is not None, reason=str(sglang_missing()))


def selected(request: pytest.FixtureRequest) -> set[str]:
    """The names of the requesting module's test functions that this session runs: a module
    starts ahead only the runs that those read."""
    return {getattr(item, "originalname", item.name) for item in request.session.items
            if getattr(item, "module", None) is request.module}


def ucm_extra(ucm: Any, **more: Any) -> dict[str, Any]:
    """The HiCache extra config that loads ucm as the storage backend (zero-copy interface)."""
    return {"backend_name": "ucm", "module_path": "ucm.sglang_hook", "class_name": "UCMStorage",
            "interface_v1": 1, "ucm": ucm, **more}


def posix(path: Path, **config: Any) -> dict[str, Any]:
    return {"tiers": [{"driver": "posix", "path": str(path)}], **config}


def run_sglang(spec: dict[str, Any], *, watchdog: float = 240, wrap: Sequence[str] = (),
               env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Runs one SGLang process; its per-prompt results (text, storage_tokens, ...). `wrap`
    prefixes its command line (`ip netns exec NS`: a process on another host); `env` adds to
    its environment."""
    spec = {"watchdog": watchdog, **spec}
    # ROOT first on SGLang's path: the ucm under test, not the one the venv installed (a
    # worktree's engine runs would load the main checkout's ucm.sglang_hook otherwise)
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
           "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([*wrap, str(SGLANG_PY), str(RUNNER), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=watchdog + 60, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return list(json.loads(line[len("RESULT "):]))
    raise SGLangFailed(proc.stdout[-3000:] + proc.stderr[-6000:])


class SGLangFailed(Exception):
    """An SGLang process ended without results; the message is its output's tail."""


def long_prompt(seed: int = 1) -> str:
    """About 700 tokens: above HiCache's 256-token prefetch threshold."""
    from ucm.bench.models import sample_text

    return sample_text(700, seed)
