"""ucm's blocks as vLLM KV events (`BlockStored`, `BlockRemoved`), for KV-aware routers.

Where each part runs, as vLLM passes events along (worker -> KVConnectorOutput -> scheduler ->
the engine's publisher, `kv_events_config`):

- worker process (`WorkerEvents`): a store's completion callback notes the digests of the
  blocks whose store completed (never a failed or dropped one); a load that finds a block
  missing or corrupt notes it as gone. vLLM takes them after each step
  (`get_kv_connector_kv_cache_events`) as `UCMKVEvents`, and sums the workers' (TP ranks).
- scheduler process (`SchedulerEvents`): it knows, for each block it asked the workers to save,
  vLLM's block hash, its parent's and its token ids. From the workers' notes
  (`update_connector_output`) it builds `BlockStored` once every rank has stored its shard,
  one per tier the store reached (`medium` "ucm:<tier name>", fastest first), and
  `BlockRemoved` for a published block a load found gone, or a lookup found only in a slower
  tier (evicted from the faster ones) or nowhere (one TP rank, whole blocks: the lookup's keys
  are the blocks'). vLLM takes them with `take_events` and
  publishes them after the step.

With vLLM's hybrid KV cache manager (several KV cache groups) a block is stored per group, so
each note names its block's group, and the events do: `group_idx`, and for BlockStored the
group's `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`, as vLLM fills them for its
own blocks (`group_metadata`). A sliding-window group stores only the window before the
prompt's hit boundary, so its events name those blocks only. One group: no group is named.

It cannot see blocks removed where it does not look: evictions by the kernel's policy are
counted, not named, so an evicted block is reported when a later lookup or load of it shows
it; a block another instance (another host on a shared store) evicted or stored is reported
by that instance only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

from ucm.config import UCMConfig
from ucm.drivers._registry import get_driver_class

MEDIUM_PREFIX = "ucm:"
# Blocks the scheduler remembers: saves planned but not yet reported (a dropped save is never
# reported), and blocks published (for their removals). The oldest go first.
_MAX_PLANNED = 1 << 16
_MAX_PUBLISHED = 1 << 20
_Key = tuple[bytes, int | None]  # a block's digest and its KV cache group (None: one group)


def medium(tier: str) -> str:
    """The `medium` of a block in ucm's tier `tier` ("ucm:memory", "ucm:posix", ...)."""
    return MEDIUM_PREFIX + tier


def tier_names(config: UCMConfig) -> list[str]:
    """The config's tier names, fastest first (a tier's name defaults to its driver's)."""
    return [t.name or t.driver for t in config.tiers]


def stored_tiers(config: UCMConfig) -> list[str]:
    """The tiers a completed store is in, fastest first: those its durability waits for (the
    kernel copies it to the rest in the background, which the connector does not see)."""
    names = tier_names(config)
    if config.durability == "memory":
        return names[:1]
    if config.durability == "local":
        for depth, tier in enumerate(config.tiers):
            if getattr(get_driver_class(tier.driver), "persistent", True):
                return names[:depth + 1]
    return names


def group_metadata(kv_cache_config: Any) -> tuple[tuple[str, int | None], ...]:
    """Each KV cache group's (kind, sliding window) as vLLM's own BlockStored names them
    (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`)."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return tuple((get_kv_cache_spec_kind(g.kv_cache_spec).value,
                  get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                 for g in getattr(kv_cache_config, "kv_cache_groups", None) or ())


class UCMStoreDone(KVCacheEvent):
    """A worker's note (never published): these blocks' stores completed on this rank;
    `groups[i]` is the KV cache group of `digests[i]` (empty with one group)."""

    digests: list[bytes]
    groups: list[int] = []


class UCMGone(KVCacheEvent):
    """A worker's note (never published): a load found these blocks missing or corrupt;
    `groups` as in UCMStoreDone."""

    digests: list[bytes]
    groups: list[int] = []


class UCMKVEvents(KVConnectorKVEvents):
    """The workers' notes of a step, as vLLM carries them to the scheduler: vLLM's
    KVOutputAggregator adds every rank's to the first's."""

    def __init__(self, events: Iterable[KVCacheEvent] = (), workers: int = 1) -> None:
        self._events: list[KVCacheEvent] = list(events)
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> UCMKVEvents:
        return self  # ranks are counted per block by the scheduler (SchedulerEvents)

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()
        self._workers = 1

    def __repr__(self) -> str:
        return f"<UCMKVEvents {len(self._events)} notes from {self._workers} workers>"


class WorkerEvents:
    """A worker's notes since vLLM last took them; written from the kernel's thread too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: list[bytes] = []
        self._stored_groups: list[int] = []
        self._gone: list[bytes] = []
        self._gone_groups: list[int] = []

    def stored(self, digests: Sequence[bytes], groups: Sequence[int] = ()) -> None:
        """`groups`: each digest's KV cache group, with several groups; () with one."""
        if digests:
            with self._lock:
                self._stored.extend(digests)
                self._stored_groups.extend(groups)

    def gone(self, digests: Sequence[bytes], groups: Sequence[int] = ()) -> None:
        if digests:
            with self._lock:
                self._gone.extend(digests)
                self._gone_groups.extend(groups)

    def take(self) -> UCMKVEvents | None:
        with self._lock:
            stored, self._stored = self._stored, []
            stored_groups, self._stored_groups = self._stored_groups, []
            gone, self._gone = self._gone, []
            gone_groups, self._gone_groups = self._gone_groups, []
        notes: list[KVCacheEvent] = []
        if stored:
            notes.append(UCMStoreDone(digests=stored, groups=stored_groups))
        if gone:
            notes.append(UCMGone(digests=gone, groups=gone_groups))
        return UCMKVEvents(notes) if notes else None


def _keyed(digests: Sequence[bytes], groups: Sequence[int]) -> list[_Key]:
    """A note's blocks as the scheduler keeps them: (digest, group; None with one group)."""
    if not groups:
        return [(d, None) for d in digests]
    return list(zip(digests, groups, strict=True))


@dataclass
class _Block:
    hash: Any  # vLLM's ExternalBlockHash: bytes, or an int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    parent: Any
    tokens: list[int]
    lora_id: int | None
    lora_name: str | None
    ranks: int = 0  # ranks whose shard is stored
    media: list[str] = field(default_factory=list)  # where it was published
    group: int | None = None  # its KV cache group, with several


class SchedulerEvents:
    """The scheduler side: vLLM's events from the workers' notes and its own lookups."""

    def __init__(self, config: UCMConfig, block_size: int, ranks: int,
                 groups: Sequence[tuple[str, int | None]] = ()) -> None:
        """`groups`: each KV cache group's (kind, sliding window) as vLLM names them
        (`group_metadata`), with several groups; () with one."""
        self.block_size = block_size
        self.ranks = ranks
        self.groups = tuple(groups)
        self.tiers = tier_names(config)
        self.media = [medium(t) for t in stored_tiers(config)]
        self._planned: OrderedDict[_Key, _Block] = OrderedDict()
        self._published: OrderedDict[_Key, _Block] = OrderedDict()
        self._events: list[KVCacheEvent] = []

    def planned(self, request: Any, first: int, digests: Sequence[bytes], *,
                group: int | None = None, positions: Sequence[int] | None = None) -> None:
        """Blocks `first`, `first + 1`, ... of `request` (or those at `positions`) are to be
        saved, with these digests, in KV cache group `group` (None: the one group)."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        hashes = getattr(request, "block_hashes", None) or []
        tokens = request.all_token_ids
        lora = getattr(request, "lora_request", None)
        bs = self.block_size
        where = range(first, first + len(digests)) if positions is None else positions
        for i, digest in zip(where, digests, strict=True):
            if i >= len(hashes):  # vLLM hashed fewer blocks (another hash block size)
                break
            parent = maybe_convert_block_hash(hashes[i - 1]) if i > 0 else None
            key = (digest, group)
            self._planned[key] = _Block(
                maybe_convert_block_hash(hashes[i]), parent, list(tokens[i * bs:(i + 1) * bs]),
                getattr(lora, "adapter_id", None) if lora else None,
                getattr(lora, "name", None) if lora else None, group=group)
            self._planned.move_to_end(key)
        while len(self._planned) > _MAX_PLANNED:
            self._planned.popitem(last=False)

    def add(self, notes: KVConnectorKVEvents | None) -> None:
        """The workers' notes of a step (vLLM's KVConnectorOutput.kv_cache_events)."""
        if not isinstance(notes, UCMKVEvents):
            return
        stored: list[_Block] = []
        for note in notes.get_all_events():
            if isinstance(note, UCMStoreDone):
                for key in _keyed(note.digests, note.groups):
                    block = self._planned.get(key)
                    if block is None:
                        continue
                    block.ranks += 1
                    if block.ranks >= self.ranks:  # every rank's shard: a stored block
                        del self._planned[key]
                        self._publish(key, block)
                        stored.append(block)
            elif isinstance(note, UCMGone):
                for key in _keyed(note.digests, note.groups):
                    self._removed(key, len(self.tiers))
        self._stored_events(stored)

    def looked_up(self, digests: Sequence[bytes], tiers: Sequence[str | None],
                  leading: int, *, group: int | None = None) -> None:
        """A prefix lookup's answer: the tier holding each of the `leading` hits, then the
        first miss. A published block found only in a slower tier left the faster ones."""
        for i, digest in enumerate(digests[:leading + 1]):
            tier = tiers[i] if i < leading and i < len(tiers) else None
            self._found((digest, group), tier)

    def looked_up_each(self, digests: Sequence[bytes], tiers: Sequence[str | None],
                       hits: Sequence[bool], *, group: int | None = None) -> None:
        """A lookup that answered every key (not a prefix): the tier holding each hit."""
        for digest, tier, hit in zip(digests, tiers, hits, strict=True):
            self._found((digest, group), tier if hit else None)

    def _found(self, key: _Key, tier: str | None) -> None:
        if key in self._published:
            depth = self.tiers.index(tier) if tier in self.tiers else len(self.tiers)
            self._removed(key, depth)

    def _publish(self, key: _Key, block: _Block) -> None:
        self._published.pop(key, None)  # stored again: the newest
        block.media = list(self.media)
        self._published[key] = block
        while len(self._published) > _MAX_PUBLISHED:
            self._published.popitem(last=False)

    def _removed(self, key: _Key, depth: int) -> None:
        """`key`'s block is in no tier faster than the tier at `depth` (len(tiers): none)."""
        block = self._published.get(key)
        if block is None:
            return
        gone = [m for m in block.media if self._depth(m) < depth]
        for m in gone:
            self._events.append(BlockRemoved(block_hashes=[block.hash], medium=m,
                                             group_idx=block.group))
        block.media = [m for m in block.media if m not in gone]
        if not block.media:
            del self._published[key]

    def _depth(self, medium_name: str) -> int:
        return self.tiers.index(medium_name[len(MEDIUM_PREFIX):])

    def _stored_events(self, blocks: list[_Block]) -> None:
        """One BlockStored per run of chained blocks of one group and tier, in the order they
        completed."""
        runs: list[list[_Block]] = []
        for block in blocks:
            last = runs[-1][-1] if runs else None
            if (last is not None and block.parent == last.hash and block.group == last.group
                    and (block.lora_id, block.lora_name) == (last.lora_id, last.lora_name)):
                runs[-1].append(block)
            else:
                runs.append([block])
        for m in self.media:
            for run in runs:
                group = run[0].group
                kind, window = (self.groups[group] if group is not None
                                and group < len(self.groups) else (None, None))
                self._events.append(BlockStored(
                    block_hashes=[b.hash for b in run], parent_block_hash=run[0].parent,
                    token_ids=[t for b in run for t in b.tokens], block_size=self.block_size,
                    lora_id=run[0].lora_id, medium=m, lora_name=run[0].lora_name,
                    group_idx=group, kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
