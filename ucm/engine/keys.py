"""Page keys: content addressed, equal in every process, restart, host and engine.

Imports no engine and no torch: every engine hook derives its keys here.

A request's pages (a vLLM block, an SGLang page) get a chain of digests: `d_i = H(d_{i-1} ||
tokens of page i)`, seeded with `d_{-1} = H(namespace || cache_salt || lora)`. The namespace
names everything that changes the bytes of a page except the TP rank (model identity, dtype,
page size, KV layout, scheme version); it is also the kernel's namespace (the storage
directory). The model identity is a fingerprint of its config and of its weights
(`weights_fingerprint`), never of its path. Each rank turns a digest into the key of its own
shard with `rank_key(digest, rank, size)`. H is BLAKE2b, never Python's `hash`, so keys do not
depend on PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from ucm.errors import ConfigError

KEY_SCHEME_VERSION = 1
DIGEST_BYTES = 16

# Fields of a Hugging Face config that name where a model lives or which library wrote it,
# not what the model computes.
_NOT_IDENTITY = {"_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
                 "_attn_implementation_autoset", "_attn_implementation"}


def _blake(data: bytes, *, person: bytes = b"") -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES, person=person[:16]).digest()


def model_identity(hf_config: Mapping[str, Any], weights: str = "") -> str:
    """A short, path-free fingerprint of a model's config dict and of its weights (what
    `weights_fingerprint` or, without a local checkpoint, the model's name says of them)."""
    clean = {k: v for k, v in hf_config.items() if k not in _NOT_IDENTITY}
    text = json.dumps(clean, sort_keys=True, default=str, separators=(",", ":"))
    if weights:
        text += "\x00" + weights
    return hashlib.sha256(text.encode()).hexdigest()[:16]


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_BYTES = 64 * 1024
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on its JSON header


def weights_fingerprint(path: str | os.PathLike[str]) -> str:
    """A cheap fingerprint of a checkpoint's weights: a model directory's weight files (or one
    weight file, as a GGUF model is given), each by name and size, a safetensors file's JSON
    header (every tensor's name, dtype, shape and offsets), and 64 KiB of its tensor bytes at
    their start, middle and end, so that equal shapes with other values differ. Reads a few
    hundred KiB whatever the size, and depends on no path, mtime or inode: the same files in
    any directory on any host give the same fingerprint. Weights that differ only outside the
    sampled bytes share it; an operator then names the model with `model_id`."""
    root = os.fspath(path)
    if os.path.isdir(root):
        names = sorted(n for n in os.listdir(root)
                       if n.endswith(WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(root, n)))
        files = [(n, os.path.join(root, n)) for n in names]
    else:  # one file: its name is not part of what it computes
        files = [("", root)]
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"ucm-weights")
    h.update(len(files).to_bytes(4, "little"))
    for name, file in files:
        h.update(name.encode() + b"\x00")
        _hash_weight_file(h, file, name or os.path.basename(root))
    return h.hexdigest()


def _hash_weight_file(h: Any, file: str, label: str) -> None:
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        size = os.fstat(fd).st_size
        h.update(size.to_bytes(8, "little"))
        start = 0
        if file.endswith(".safetensors"):
            head = _read_at(fd, 8, 0)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
                raise ConfigError(f"model weights {label}: not a safetensors file (header "
                                  f"length {length} in a file of {size} bytes)")
            header = _read_at(fd, length, 8)
            if len(header) != length:
                raise ConfigError(f"model weights {label}: safetensors header cut short")
            h.update(header)
            start = 8 + length
        span = size - start
        for offset in sorted({start, start + max(span - SAMPLE_BYTES, 0) // 2,
                              max(size - SAMPLE_BYTES, start)}):
            h.update(_read_at(fd, SAMPLE_BYTES, offset))
    finally:
        os.close(fd)


def _read_at(fd: int, n: int, offset: int) -> bytes:
    """Up to `n` bytes at `offset`: fewer only at the end of the file (a short read goes on)."""
    parts = []
    while n > 0:
        part = os.pread(fd, n, offset)
        if not part:
            break
        parts.append(part)
        n -= len(part)
        offset += len(part)
    return b"".join(parts)


def make_namespace(*, model_type: str, model_id: str, dtype: str, block_size: int,
                   kv_layout: str) -> str:
    """The rank-independent namespace string: readable, under 255 bytes, safe in paths."""
    parts = [model_type or "model", model_id, dtype.replace("torch.", ""), f"bs{block_size}",
             kv_layout, f"k{KEY_SCHEME_VERSION}"]
    return "-".join(_safe(p) for p in parts)[:200]


def _safe(part: str) -> str:
    return "".join(c if c.isalnum() or c in "._" else "_" for c in str(part))


def chain_seed(namespace: str, *, cache_salt: str | None = None, lora: str | None = None,
               ) -> bytes:
    """The digest before a request's first block."""
    fields = [namespace, cache_salt or "", lora or ""]
    return _blake("\x00".join(fields).encode(), person=b"ucm-seed")


def chain_digests(seed: bytes, token_ids: Sequence[int], block_size: int, n_blocks: int, *,
                  start: int = 0, prev: bytes | None = None) -> list[bytes]:
    """Digests of blocks `start .. n_blocks-1`; `prev` is block `start-1`'s digest (the seed
    when `start` is 0)."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    if n_blocks * block_size > len(token_ids):
        raise ValueError(f"{n_blocks} blocks of {block_size} need {n_blocks * block_size} "
                         f"tokens; the request has {len(token_ids)}")
    digest = seed if prev is None else prev
    out = []
    for i in range(start, n_blocks):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size])
        digest = _blake(digest + _le(block), person=b"ucm-block")
        out.append(digest)
    return out


def _le(block: array[int]) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        block = array(block.typecode, block)
        block.byteswap()
    return block.tobytes()


def rank_key(digest: bytes, rank: int, size: int) -> bytes:
    """The storage key of one rank's shard of the block named by `digest`."""
    if size == 1:
        return digest
    return _blake(digest + rank.to_bytes(4, "little") + size.to_bytes(4, "little"),
                  person=b"ucm-rank")


def foreign_key(seed: bytes, digest: bytes) -> bytes:
    """The key of a page an engine names by its own chain of digests over the token ids
    (SGLang's SHA-256 chain): the digest placed in this namespace's chain (`seed`), so equal
    tokens under another model, dtype or layout never share a key."""
    return _blake(seed + digest, person=b"ucm-foreign")


def layer_key(key: bytes, layer: int) -> bytes:
    """The storage key of one layer of a block (the layerwise mode stores each layer of each
    block as a block of its own, so a layer is verified, and can be used, on its own)."""
    return key + b"/L" + layer.to_bytes(2, "little")


class RequestChain:
    """A request's digests, extended as its tokens grow (prompt, then generated tokens)."""

    __slots__ = ("block_size", "digests", "seed")

    def __init__(self, seed: bytes, block_size: int) -> None:
        self.seed = seed
        self.block_size = block_size
        self.digests: list[bytes] = []

    def upto(self, token_ids: Sequence[int], n_blocks: int) -> list[bytes]:
        """The digests of the first `n_blocks` blocks (computed once, then cached)."""
        have = len(self.digests)
        if n_blocks > have:
            prev = self.digests[-1] if have else None
            self.digests += chain_digests(self.seed, token_ids, self.block_size, n_blocks,
                                          start=have, prev=prev)
        return self.digests[:n_blocks]
