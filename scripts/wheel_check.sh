#!/usr/bin/env bash
# ucm as a user installs it: builds the wheel from a copy of the source (tracked and new files,
# nothing stale from build/), installs it with its base requirements and the `testing` extra
# into a fresh venv in a temp dir, then, from a directory outside the source tree: imports every
# module of the installed package (a module may skip only for a missing optional extra, named
# in EXTRAS below and in the output), stores and loads a block through the kernel on a posix
# tier, runs `ucm --help` and `ucm-trace --help`, and runs the driver contract suite through
# the pytest plugin (--ucm-driver) against the example driver (examples/sqlite-driver),
# installed from its own wheel. Any failure stops it with a non-zero status.
#   PYTHON: the interpreter the venv is made from (python3); UCM_WHEEL_KEEP=1 keeps the dir.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
python=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/ucm-wheel-check.XXXXXX")
[ "${UCM_WHEEL_KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
say() { echo "[wheel] $* ($((SECONDS - start)) s)"; }
fail() { echo "[wheel] FAILED: $*" >&2; exit 1; }

# The source as committed plus new files; build/, .venv and built .so files stay behind.
mkdir -p "$work/src" "$work/dist" "$work/run" "$work/hooks"
if git -c safe.directory="$PWD" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -c safe.directory="$PWD" ls-files -z -co --exclude-standard |
        tar --null -T - -cf - | tar -xf - -C "$work/src"
else  # not a git checkout
    tar --exclude=./.venv --exclude=./.venv-sglang --exclude=./build --exclude='*.egg-info' \
        --exclude='__pycache__' --exclude='./ucm/*.so' -cf - . | tar -xf - -C "$work/src"
fi
# The venv's own pip builds and installs: the host's python3 needs only venv (as setup.sh).
"$python" -m venv "$work/venv"
venv="$work/venv"
pip() { "$venv/bin/python" -m pip --quiet --disable-pip-version-check "$@"; }
say "building the ucm and example-driver wheels"
pip wheel --no-deps -w "$work/dist" "$work/src" "$work/src/examples/sqlite-driver" \
    >"$work/build.log" 2>&1 || { cat "$work/build.log" >&2; fail "pip wheel"; }
wheel=$(ls "$work"/dist/ucm-[0-9]*.whl)
example=$(ls "$work"/dist/ucm_sqlite-*.whl)
say "installing $(basename "$wheel")[testing] and $(basename "$example") into the fresh venv"
pip install "$wheel[testing]" "$example" || fail "pip install of the wheels"

# From here on: no source tree on the path, no user site, the venv's own interpreter.
cd "$work/run"
unset PYTHONPATH PYTHONHOME
export PYTHONNOUSERSITE=1
run() { "$venv/bin/python" "$@"; }

say "importing every module of the installed package"
run - "$venv" <<'EOF' || fail "imports"
import importlib, os, pkgutil, sys

venv = os.path.realpath(sys.argv[1])
import ucm
where = os.path.realpath(ucm.__file__)
if not where.startswith(venv + os.sep):
    sys.exit(f"ucm imported from {where}, not from the venv {venv}")
print(f"  ucm from {os.path.dirname(where)}")
# Third-party modules that only an optional extra (or SGLang's own setup) installs. A module
# whose import fails for one of these skips; any other failure is an error.
EXTRAS = {"torch": "torch", "vllm": "vllm", "transformers": "vllm", "gguf": "vllm",
          "cupy": "cupy", "matplotlib": "trace", "prometheus_client": "trace",
          "httpx": "s3", "botocore": "s3", "mooncake": "mooncake", "nfs_rs": "nfs",
          "redis": "redis", "sglang": "SGLang (scripts/sglang/setup.sh)"}
imported, skipped, failed = [], {}, []

def missing_extra(exc):
    """The EXTRAS module whose absence caused `exc` (raised by it or chained to it), if any."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError):
            top = (exc.name or "").split(".")[0]
            if top in EXTRAS:
                return top
        exc = exc.__cause__ or exc.__context__
    return None

def visit(name):
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        top = missing_extra(exc)
        if top:
            skipped.setdefault(f"{EXTRAS[top]} ({top})", []).append(name)
        else:
            failed.append(f"{name}: {exc!r}")
        return
    imported.append(name)
    for info in pkgutil.iter_modules(getattr(module, "__path__", []) or []):
        visit(f"{name}.{info.name}")

visit("ucm")
for extra, names in sorted(skipped.items()):
    print(f"  skipped, needs the extra {extra}: {', '.join(names)}")
print(f"  imported {len(imported)} modules, skipped {sum(map(len, skipped.values()))}")
native = [n for n in ("ucm._hostcopy", "ucm._kvcodec", "ucm._mrcsim") if n in imported]
print(f"  native extensions in the wheel: {', '.join(native) or 'none (no C compiler or xxhash.h at build)'}")
missing = {"ucm.drivers.posix", "ucm.drivers.kit", "ucm.codecs", "ucm.kernel",
           "ucm.testing.plugin", "ucm.tools.trace_cli"} - set(imported)
if missing:
    failed.append(f"core modules not imported: {sorted(missing)}")
if failed:
    print("\n".join(f"  FAILED {f}" for f in failed), file=sys.stderr)
    sys.exit(1)
EOF

say "a kernel Store, then Load from a second kernel, on a posix tier"
run - "$work/store" <<'EOF' || fail "kernel round trip"
import os, sys
from ucm.drivers import LoadState
from ucm.kernel import Kernel, Load, Lookup, Store

config = {"tiers": [{"driver": "posix", "path": sys.argv[1], "capacity": "64MiB"}]}
blocks = {b"wheel-check-%d" % i: os.urandom(256 * 1024) for i in range(4)}
kernel = Kernel(config)
stored = kernel.submit(Store(list(blocks), buffers=list(blocks.values()))).result(60)
kernel.close()
assert stored.ok, stored
kernel = Kernel(config)  # a fresh kernel: the blocks come from the files
try:
    kernel.wait_indexed()
    hits = kernel.submit(Lookup(list(blocks), prefix=True)).result(60).prefix_len
    assert hits == len(blocks), hits
    out = [bytearray(len(b)) for b in blocks.values()]
    loaded = kernel.submit(Load(list(blocks), buffers=out)).result(60)
    assert loaded.states == (LoadState.OK,) * len(blocks), loaded
    assert [bytes(o) for o in out] == list(blocks.values())
finally:
    kernel.close()
print(f"  {len(blocks)} blocks stored and loaded back, bytes equal")
EOF

say "the live miss-ratio curve on a memory tier (in C where the wheel has ucm._mrcsim)"
run - <<'EOF' || fail "miss-ratio curve"
import hashlib, importlib.util
from ucm.kernel import Kernel, Store
from ucm.kernel._mrc import MissRatioCurve

config = {"tiers": [{"driver": "memory", "name": "mem", "capacity": "4MiB"}], "mrc": {}}
keys = [hashlib.blake2b(b"%d" % (i % 300), digest_size=16).digest() for i in range(1200)]
with Kernel(config) as kernel:
    for i in range(0, len(keys), 12):
        assert kernel.submit(Store(keys[i:i + 12], buffers=[bytes(16384)] * 12)).result(60).ok
    snap = kernel.statistics()["tier.mem.mrc"]
native = importlib.util.find_spec("ucm._mrcsim") is not None
front = type(MissRatioCurve("shadow", [4]).front).__module__
assert front == ("ucm._mrcsim" if native else "ucm.kernel._mrc"), front
assert snap["accesses"] > 0 and snap["sampled"] > 0, snap
print(f"  {snap['accesses']} references, {snap['sampled']} sampled, front {front}")
EOF

say "ucm --help, ucm-trace --help"
"$venv/bin/ucm" --help >"$work/ucm-help.txt" || fail "ucm --help"
"$venv/bin/ucm-trace" --help >"$work/trace-help.txt" || fail "ucm-trace --help"
grep -q "usage: ucm " "$work/ucm-help.txt" || fail "ucm --help printed no usage"
grep -q "usage: ucm-trace" "$work/trace-help.txt" || fail "ucm-trace --help printed no usage"

say "the contract suite through the pytest plugin against the installed example driver"
# The damage hooks the example's own tests use, as a module outside every source tree.
cp "$work/src/examples/sqlite-driver/tests/conftest.py" "$work/hooks/ucm_sqlite_hooks.py"
PYTHONPATH="$work/hooks" run -m pytest -q -p no:cacheprovider -o trio_mode=true \
    --ucm-driver ucm_sqlite:SqliteDriver --ucm-driver-options '{"path": "{tmp}/blocks.db"}' \
    --ucm-cross-process --ucm-driver-corrupt ucm_sqlite_hooks:flip_payload_byte \
    >"$work/contract.log" 2>&1 || { tail -40 "$work/contract.log" >&2; fail "contract suite"; }
tail -1 "$work/contract.log" | sed 's/^/  /'
run - <<'EOF' || fail "the plugin ran the example from the venv"
import ucm_sqlite, ucm.testing, os, sys
for m in (ucm_sqlite, ucm.testing):
    assert os.path.realpath(m.__file__).startswith(os.path.realpath(sys.prefix)), m.__file__
EOF
say "passed"
