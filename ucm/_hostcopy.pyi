# The types of ucm._hostcopy, the C extension built from native/hostcopy.c (mypy cannot read a .so).
from typing_extensions import Buffer

IMPL: str  # the loop this CPU runs: "avx2" or "portable"

# dst: one writable buffer, or a list or tuple of them filled in order
def hash_copy(dst: Buffer | list[Buffer] | tuple[Buffer, ...], src: Buffer, /) -> int: ...
def hash_copy_portable(dst: Buffer | list[Buffer] | tuple[Buffer, ...], src: Buffer, /) -> int: ...
