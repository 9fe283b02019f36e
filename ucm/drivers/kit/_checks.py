"""Arguments checked as the driver contract says, and failures named in the ucm error tree."""

from __future__ import annotations

import errno
import hashlib
import os
import re
from collections.abc import Sequence
from typing import Any

from ucm.block import BlockHeader, Codec, Scatter, as_byte_view, check_key
from ucm.errors import (
    ConfigError,
    DriverError,
    InvalidRequest,
    NoCapacity,
    StorageUnavailable,
)


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """The keys as a list, or InvalidRequest naming the first problem."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise InvalidRequest("keys must be a sequence of bytes keys, not a single key")
    keys = list(keys)
    if not keys:
        raise InvalidRequest("empty batch: pass at least one key")
    for key in keys:
        check_key(key)
    return keys


def check_batch(
    keys: Sequence[bytes], buffers: Sequence[Any], *, writable: bool, scatter: bool = False,
) -> tuple[list[bytes], list[memoryview | Scatter]]:
    """Validated keys and flat byte views of their buffers (one per key); a load's Scatter
    as it is, and a store's where the driver writes from one (`scatter`)."""
    keys = check_keys(keys)
    buffers = list(buffers)
    if len(buffers) != len(keys):
        raise InvalidRequest(f"{len(keys)} keys but {len(buffers)} buffers")
    views: list[memoryview | Scatter] = []
    for i, buf in enumerate(buffers):
        if (writable or scatter) and type(buf) is Scatter:
            views.append(buf)
            continue
        try:
            view = as_byte_view(buf)
        except TypeError:
            raise InvalidRequest(f"buffer {i} is a {type(buf).__name__}, not a buffer") from None
        if writable and view.readonly:
            raise InvalidRequest(f"buffer {i} is read-only; a load needs a writable buffer")
        views.append(view)
    return keys, views


def size_mismatch(view: memoryview | Scatter, header: BlockHeader) -> InvalidRequest:
    """The error for a load buffer whose size differs from a block that never left this
    process (the memory tier's): the caller's mistake. A block read from storage that holds
    another size is `wrong_size` (BlockCorrupt): storage that lies or another layout, CORRUPT
    for that key and never a failed batch."""
    return InvalidRequest(f"buffer is {view.nbytes} bytes; the block holds {header.raw_len}")


def os_error(exc: OSError, driver: str) -> DriverError:
    """Translates an OSError that failed a whole batch into the ucm tree."""
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why = f": {exc.strerror}" if exc.strerror != os.strerror(exc.errno) else ""
        return NoCapacity(f"no space left{why}{where}", driver=driver)
    return StorageUnavailable(f"{exc.strerror or exc}{where}", driver=driver)


def parse_codec(codec: str | Codec) -> Codec:
    """A codec option parsed, or ConfigError."""
    try:
        return Codec.parse(codec)
    except InvalidRequest as exc:
        raise ConfigError(f"codec: {exc}") from None



_PLAIN = re.compile(r"[A-Za-z0-9_.-]{1,255}")
_ESCAPED = re.compile(r".*-[0-9a-f]{16}")  # what every escaped name ends with


def safe_dir_name(namespace: str) -> str:
    """A directory name for a namespace, one per namespace: the namespace itself when it is
    plain (ASCII letters, digits, '-', '_', '.'; not starting with '.'; not ending like an
    escaped name), else an ASCII prefix of it plus '-' and a digest of the whole namespace.
    A plain name never ends with '-' and 16 hex digits and every escaped one does, so the two
    kinds never meet; the result is one path component of at most 81 bytes when escaped."""
    if (_PLAIN.fullmatch(namespace) and not namespace.startswith(".")
            and not _ESCAPED.fullmatch(namespace)):
        return namespace
    plain = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_"
                    for c in namespace)
    digest = hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()
    return f"{plain.lstrip('.')[:64]}-{digest}"


def pid_alive(pid: int) -> bool:
    """Whether a process of this host is alive (for stores shared between processes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
