"""The prefix index of `ucm proxy --route prefix`: which instance holds which chain of token
blocks in which media, fed by the instances' vLLM KV events (ZMQ, msgpack) and keyed by token
content, so instances with different hash seeds agree; and the request fields the proxy
tokenizes to look a prompt up in it."""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

# Media by speed, fastest first: the engine's own prefix cache (vLLM's "GPU", also on CPU builds;
# None), vLLM's CPU offload, then ucm's tiers by driver (ucm.vllm_hook.events names them
# "ucm:<tier name>"). A medium not listed ranks after them all.
MEDIA = (("GPU", None), ("CPU",), ("ucm:memory",), ("ucm:pmem",), ("ucm:mooncake",),
         ("ucm:redis",), ("ucm:posix",), ("ucm:nfs",), ("ucm:s3",))
_RANKS = {m: r for r, names in enumerate(MEDIA) for m in names}
_UNRANKED = len(MEDIA)
MAX_INDEXED_BLOCKS = 1 << 20  # block hashes kept per instance (each about 200 bytes)


def medium_rank(medium: str | None) -> int:
    """A medium's place in MEDIA (0: fastest); one past the end for a medium not listed."""
    return _RANKS.get(medium, _UNRANKED)


def parse_endpoints(value: str, option: str) -> list[str]:
    """The comma-separated ZMQ endpoints of `option` (tcp://HOST:PORT or ipc://PATH)."""
    endpoints = [e.strip() for e in value.split(",") if e.strip()]
    if not endpoints:
        raise ValueError(f"{option} needs at least one endpoint")
    for endpoint in endpoints:
        parts = urlsplit(endpoint)
        if parts.scheme == "ipc" and (parts.netloc or parts.path):
            continue
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "tcp" or not parts.hostname or parts.hostname == "*" or not port:
            raise ValueError(f"{option}: {endpoint!r} is not a tcp://HOST:PORT (or ipc://PATH) "
                             "endpoint to connect to")
    return endpoints


def _root(lora_name: str | None) -> bytes:
    return hashlib.blake2b(b"ucm-proxy\0" + (lora_name or "").encode(), digest_size=16).digest()


def _child(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens),
                           digest_size=16).digest()


def chain_keys(tokens: Sequence[int], block_size: int, lora_name: str | None = None,
               ) -> list[bytes]:
    """The keys of `tokens`' full blocks: each names the block's tokens and all before them
    (by content, so no engine's hash seed matters)."""
    keys, key = [], _root(lora_name)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = _child(key, tokens[start:start + block_size])
        keys.append(key)
    return keys


class PrefixIndex:
    """Which instance holds which chain of token blocks, in which media, as their KV events
    (vLLM's msgpack KVEventBatch) say. Keyed by token content; an instance's block hashes
    only lead to its own keys (to place the blocks an event chains onto a parent). At most
    `max_blocks` block hashes per instance are kept: beyond, the oldest stored are forgotten
    (counted), as if removed."""

    def __init__(self, instances: Sequence[str], max_blocks: int = MAX_INDEXED_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, not {max_blocks}")
        self.instances = list(instances)
        self.max_blocks = max_blocks
        self._held: dict[bytes, dict[str, set[str | None]]] = {}  # key -> instance -> media
        self._keys: dict[str, dict[Any, bytes]] = {i: {} for i in instances}  # hash -> key
        self._block_size: dict[str, int] = {}
        self.counts: Counter[str] = Counter()

    def apply(self, instance: str, payload: bytes) -> None:
        """One published batch of `instance`'s events; a batch that is not one is counted
        (an unhashable block hash is one)."""
        import msgspec

        try:
            batch = msgspec.msgpack.decode(payload)
            events = batch[1]
            assert isinstance(events, list)
        except (msgspec.DecodeError, TypeError, IndexError, KeyError, AssertionError):
            self.counts["undecodable_batches"] += 1
            return
        self.counts["batches"] += 1
        for event in events:
            kind = event.get("type") if isinstance(event, dict) else None
            try:
                if kind == "BlockStored":
                    self._stored(instance, event)
                elif kind == "BlockRemoved":
                    self._removed(instance, event)
                elif kind == "AllBlocksCleared":
                    self._cleared(instance)
                else:
                    self.counts["unknown_events"] += 1
            except (TypeError, ValueError, KeyError, struct.error):
                self.counts["undecodable_events"] += 1

    def _stored(self, instance: str, event: dict[str, Any]) -> None:
        hashes, tokens = event["block_hashes"], event["token_ids"]
        size, parent = int(event["block_size"]), event["parent_block_hash"]
        if size <= 0 or len(tokens) != size * len(hashes):
            raise ValueError("token_ids do not fill the blocks")
        known = self._keys[instance]
        key = _root(event.get("lora_name")) if parent is None else known.get(parent)
        if key is None:  # its parent's event was missed (or published before we subscribed)
            self.counts["orphan_blocks"] += len(hashes)
            return
        self._block_size[instance] = size
        for i, block_hash in enumerate(hashes):
            key = _child(key, tokens[i * size:(i + 1) * size])
            known.pop(block_hash, None)  # stored again: the newest
            known[block_hash] = key
            self._held.setdefault(key, {}).setdefault(instance, set()).add(event.get("medium"))
        self.counts["stored_blocks"] += len(hashes)
        while len(known) > self.max_blocks:  # dicts keep insertion order: the oldest first
            old_hash = next(iter(known))
            self._forget(instance, known.pop(old_hash))
            self.counts["forgotten_blocks"] += 1

    def _removed(self, instance: str, event: dict[str, Any]) -> None:
        known = self._keys[instance]
        for block_hash in event["block_hashes"]:
            key = known.get(block_hash)
            media = self._held.get(key, {}).get(instance) if key is not None else None
            if key is None or media is None:
                continue
            media.discard(event.get("medium"))
            self.counts["removed_blocks"] += 1
            if not media:
                self._forget(instance, key)
                del known[block_hash]

    def _cleared(self, instance: str) -> None:
        """vLLM cleared its own prefix cache: ucm's tiers keep theirs."""
        self.counts["cleared"] += 1
        known = self._keys[instance]
        for block_hash, key in list(known.items()):
            media = self._held.get(key, {}).get(instance, set())
            media.difference_update({m for m in media if not (m or "").startswith("ucm:")})
            if not media:
                self._forget(instance, key)
                del known[block_hash]

    def forget(self, instance: str) -> None:
        """Everything `instance` held."""
        for key in self._keys[instance].values():
            self._forget(instance, key)
        self._keys[instance].clear()
        self._block_size.pop(instance, None)

    def _forget(self, instance: str, key: bytes) -> None:
        holders = self._held.get(key, {})
        holders.pop(instance, None)
        if not holders:
            self._held.pop(key, None)

    def score(self, instance: str, tokens: Sequence[int], lora_name: str | None = None,
              ) -> tuple[int, ...]:
        """For each medium rank, fastest first, the leading blocks of `tokens` the instance
        holds in media that fast or faster; the last entry: in any medium."""
        size = self._block_size.get(instance)
        out = [0] * (_UNRANKED + 1)
        if size is None:
            return tuple(out)
        open_ranks = set(range(_UNRANKED + 1))
        for key in chain_keys(tokens, size, lora_name):
            media = self._held.get(key, {}).get(instance)
            best = min((medium_rank(m) for m in media), default=None) if media else None
            if best is None:
                break
            for r in list(open_ranks):
                if r >= best:
                    out[r] += 1
                else:
                    open_ranks.discard(r)  # a prefix held this fast has ended
            if not open_ranks:
                break
        return tuple(out)

    def order(self, tokens: Sequence[int] | None, turn: Sequence[str],
              lora_name: str | None = None) -> list[str]:
        """`turn` (the round-robin order) with the instances whose fastest media hold the
        longest prefix of `tokens` first; equal ones keep their turn."""
        if tokens is None:
            return list(turn)
        scores = {i: self.score(i, tokens, lora_name) for i in turn}
        return sorted(turn, key=lambda i: tuple(-s for s in scores[i]))

    def statistics(self) -> dict[str, Any]:
        return {"blocks": len(self._held), **self.counts}



def tokenize_body(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The /tokenize request that gives a generation request's prompt tokens as the instance
    computes them (its chat template applied); None when the prompt is not one text."""
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list):
            return None
        keep: tuple[str, ...] = (
            "model", "messages", "add_generation_prompt", "continue_final_message",
            "chat_template", "chat_template_kwargs", "tools", "add_special_tokens")
        return {k: body[k] for k in keep if k in body}
    if not isinstance(body.get("prompt"), str):
        return None
    keep = ("model", "prompt", "add_special_tokens")
    return {k: body[k] for k in keep if k in body}


def prompt_tokens(body: dict[str, Any]) -> list[int] | None:
    """A completion request's prompt when it is given as token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    return None
