"""native/ built with AddressSanitizer and UndefinedBehaviorSanitizer (-fno-sanitize-recover:
the first report ends the run), driven by tests/_native_corpus.py over valid and forged blocks
through the AVX2 and the portable loops of ucm._kvcodec and ucm._hostcopy (issue 32). Any
report fails the test, with the report. Skipped only where the C compiler cannot build with
the sanitizers or xxhash.h is missing (setup.py then builds nothing either)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NATIVE = REPO / "native"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer"]


def _compiler() -> str:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "gcc"
    return cc.split()[0]


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory) -> tuple[Path, Path, str]:
    """(kvcodec .so, hostcopy .so, the ASan runtime to preload), built here."""
    cc = _compiler()
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the native loops are not built either")
    out = tmp_path_factory.mktemp("sanitized")
    probe = out / "probe.c"
    probe.write_text("#define XXH_INLINE_ALL\n#include <xxhash.h>\n"
                     "int main(void) { return (int)XXH3_64bits(\"\", 0); }\n")
    done = _run([cc, *SANITIZE, str(probe), "-o", str(out / "probe")])
    if done.returncode != 0:
        pytest.skip(f"{cc} cannot build with -fsanitize=address,undefined and xxhash.h: "
                    f"{done.stderr.strip()[-300:]}")
    asan = _run([cc, "-print-file-name=libasan.so"]).stdout.strip()
    if not os.path.isabs(asan) or not os.path.exists(asan):
        pytest.skip(f"{cc} names no ASan runtime to preload (got {asan!r})")
    include = sysconfig.get_paths()["include"]
    builds = {}
    for name, sources, extra in (  # setup.py's two extensions, each a compiler of its own
            ("_kvcodec", ["kvcodec.c", "kvcodec_avx2.c"], ["-ffp-contract=off"]),
            ("_hostcopy", ["hostcopy.c", "hostcopy_avx2.c"], [])):
        builds[name] = subprocess.Popen(
            [cc, "-shared", "-fPIC", "-O1", "-g", *SANITIZE, *extra, f"-I{include}",
             *(str(NATIVE / s) for s in sources), "-o", str(out / f"{name}.so")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, build in builds.items():
        text = build.communicate(timeout=300)[0]
        assert build.returncode == 0, f"building {name} with the sanitizers:\n{text}"
    return out / "_kvcodec.so", out / "_hostcopy.so", asan


def test_native_loops_run_clean_under_asan_and_ubsan(sanitized):
    kvcodec, hostcopy, asan = sanitized
    env = {**os.environ, "LD_PRELOAD": asan, "PYTHONMALLOC": "malloc",
           # Python itself leaks by design at exit; the loops allocate nothing they keep
           "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = _run([sys.executable, str(Path(__file__).with_name("_native_corpus.py")),
                 str(kvcodec), str(hostcopy)], env=env, cwd=REPO)
    report = done.stderr + done.stdout
    assert done.returncode == 0 and "runtime error" not in report \
        and "Sanitizer" not in report, f"sanitizer run failed (rc {done.returncode}):\n" \
        f"{report[-6000:]}"
    line = done.stdout.strip().splitlines()[-1]
    fields = dict(f.split("=") for f in line.split() if "=" in f)
    # every kind of input reached the loops (both loop sets ran each decode: see the corpus)
    for what in ("decode", "encode", "forged_payload", "plan_refused", "load_path",
                 "load_path_corrupt", "params_refused", "hash_copy", "copy_verified"):
        assert int(fields.get(what, 0)) > 0, f"the corpus never reached {what}: {line}"
    if _cpu_has("avx2", "f16c"):  # the loops chosen at import are the AVX2 ones: both ran
        assert line.split()[1:3] == ["avx2", "avx2"], line


def _cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(text.split())
    return all(flag in words for flag in flags)
