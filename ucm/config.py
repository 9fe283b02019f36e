"""The one typed config schema. Loads from a dict, a YAML or JSON file, or nothing (the
embedded default: a memory tier over a posix tier in the user's cache directory).

    tiers:
      - driver: memory
        capacity: 2GiB
      - driver: posix
        path: /var/cache/ucm
        capacity: 100GiB

Keys other than the common tier keys below are the driver's own options, checked against the
driver's `Options` model. Unknown keys and bad values raise ConfigError naming the key (a key
of an earlier schema says what replaces it).

Each thing has one key: a tier's `codec` sets how it stores payloads, the top-level `codec` the
default of every tier that sets none.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretBytes,
    SecretStr,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ucm.block import MAX_NAMESPACE_BYTES
from ucm.drivers import DriverOptions, get_driver_class
from ucm.errors import ConfigError

# When a store completes: the config's default and a Store event's own (ucm.kernel).
Durability = Literal["memory", "local", "all"]

_TIER_KEYS = {"driver", "name", "capacity", "codec", "concurrency", "options"}
CodecName = Literal["none", "zstd", "shuffle_zstd", "int8", "int4"]
_CODECS = ("none, zstd, shuffle_zstd, int8 or int4 (compression's method lossless is "
           "shuffle_zstd; quantize with bits 8 or 4 is int8 or int4)")
# Keys of earlier schemas, by the end of their path (list indices left out): what to use.
RETIRED_KEYS = {
    ("ucm_compression",): f"use the top-level `codec`, every tier's default: {_CODECS}",
    ("tiers", "compression"): f"use the tier's `codec`: {_CODECS}",
}


class _Strict(BaseModel):
    # Errors name the key, never echo its value: a rejected value may hold a secret.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class TierConfig(_Strict):
    driver: str = Field(description="the driver's registered name (memory, posix, s3, ...)")
    name: str | None = Field(default=None, description="the tier's name; default: the driver's")
    capacity: ByteSize | None = Field(
        default=None, description="bytes the kernel lets this tier hold (> 0); null: unbounded")
    codec: CodecName | None = Field(
        default=None, description="how this tier stores payloads: none, zstd, shuffle_zstd "
        "(byte planes, then zstd: lossless), int8 or int4 (KIVI quantization of KV blocks "
        "whose layout the engine hook gave the kernel; any other block goes shuffle_zstd); "
        "loads decode any codec. null: the top-level `codec`")
    concurrency: int = Field(default=8, ge=1, le=1024,
                             description="driver calls in flight at once on this tier")
    # SerializeAsAny: dumps hold the driver's own options (secrets starred), not those of the
    # DriverOptions base, which has none.
    options: SerializeAsAny[DriverOptions] = Field(
        description="the driver's own options; usually written inline in the tier")

    @model_validator(mode="before")
    @classmethod
    def _split_driver_options(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        if "driver" not in data:
            raise ValueError("each tier needs a 'driver' key")
        if isinstance(data.get("options"), DriverOptions):
            return data
        common = {k: v for k, v in data.items() if k in _TIER_KEYS and k != "options"}
        own = dict(data.get("options") or {})
        own.update({k: v for k, v in data.items() if k not in _TIER_KEYS})
        factory = get_driver_class(str(data["driver"]))
        common["options"] = factory.Options(**own)
        return common

    @field_validator("capacity")
    @classmethod
    def _positive_capacity(cls, capacity: ByteSize | None) -> ByteSize | None:
        if capacity is not None and capacity <= 0:
            raise ValueError("must be > 0 bytes (leave it out for an unbounded tier)")
        return capacity


class TraceConfig(_Strict):
    path: Path = Field(description="directory of the rolling trace segment files")
    max_bytes: ByteSize = Field(default=ByteSize(256 * 2**20), gt=0,
                                description="total size of the segments; the oldest go first")
    segment_bytes: ByteSize = Field(default=ByteSize(8 * 2**20), gt=0,
                                    description="size at which a segment file is closed; at "
                                    "most max_bytes")
    ring_events: int = Field(default=65536, ge=64,
                             description="records held between drains; when full the oldest drop")

    @field_validator("segment_bytes")
    @classmethod
    def _segment_within_max(cls, value: ByteSize, info: ValidationInfo) -> ByteSize:
        max_bytes = info.data.get("max_bytes")  # absent when max_bytes itself was invalid
        if max_bytes is not None and value > max_bytes:
            raise ValueError(f"must be at most trace.max_bytes ({int(max_bytes)} bytes), "
                             f"got {int(value)}")
        return value


class ThreadsConfig(_Strict):
    copy_threads: int = Field(default=2, ge=1, le=64,
                              description="copy threads that loads of large batches use")
    pin_copy: bool = Field(default=True, description="bind each copy thread to a CPU of its "
                           "own (the last ones the process may use)")
    store_threads: int = Field(default=8, ge=1, le=256,
                               description="idle-priority threads that stores run on; more wait")


class MRCConfig(_Strict):
    sample_rate: float = Field(default=0.01, gt=0, le=1,
                               description="share of keys sampled at first (by a hash of the "
                               "key); lowered when the sample outgrows max_keys")
    max_keys: int = Field(default=16384, ge=64,
                          description="keys one tier's miniature caches hold together (their "
                          "ghost lists add up to 4x): the memory budget; over it the rate drops")
    min_blocks: int | None = Field(
        default=None, ge=0,
        description="a capacity's miniature samples more where the rate would leave it under "
        "this many blocks (more accurate small capacities, more CPU); null: 1000 where the "
        "curve runs in C (lru and shadow with ucm._mrcsim built: within 2 points of the exact "
        "curve, under 1 % of the kernel's CPU), else 0 (the Python miniatures cost about 30x)")
    capacities: list[ByteSize] | None = Field(
        default=None, description="the capacities the curve is computed at; null: 1/16 to 4x "
        "each tier's capacity (an unbounded tier then has no curve)")

    @field_validator("capacities")
    @classmethod
    def _positive_sizes(cls, sizes: list[ByteSize] | None) -> list[ByteSize] | None:
        if sizes is not None and (not sizes or min(sizes) <= 0):
            raise ValueError("must be a non-empty list of sizes > 0 bytes")
        return sizes


class SessionsConfig(_Strict):
    max_pinned: str | ByteSize = Field(
        default="50%", description="bytes of each tier that session holds may keep from "
        "eviction: a share of its capacity (\"50%\"; a tier without capacity: no cap) or "
        "bytes; over it, the oldest holds are released first")
    max_retain_s: float = Field(default=3600.0, gt=0,
                                description="the longest retain_s a session hint may ask for; "
                                "a hint over it is ignored (counted)")
    predict_next_turn: bool = Field(
        default=False, description="without hints: recognise conversations by their chains "
        "and prefetch a returning one's blocks into the fastest tier when its next turn is "
        "predicted (its last gap); counted, off by default: it did not pay in the simulator "
        "(docs/autotune.md, History-based prefetch)")

    @field_validator("max_pinned", mode="before")
    @classmethod
    def _share_or_bytes(cls, value: Any) -> str | ByteSize:
        if isinstance(value, str) and value.strip().endswith("%"):
            try:
                share = float(value.strip()[:-1])
            except ValueError:
                raise ValueError(f"must be a share such as '50%' or bytes, got {value!r}"
                                 ) from None
            if not 0 <= share <= 100 or math.isnan(share):
                raise ValueError(f"a share must be 0% to 100%, got {value!r}")
            return value.strip()
        if isinstance(value, str):
            try:
                value = TypeAdapter(ByteSize).validate_python(value)
            except Exception:
                raise ValueError(f"must be a share such as '50%' or bytes, got {value!r}"
                                 ) from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"must be a share such as '50%' or bytes >= 0, got {value!r}")
        return ByteSize(value)

    def cap_bytes(self, capacity: int | None) -> int | None:
        """The held-bytes cap of a tier of `capacity` bytes (None: unbounded)."""
        value = self.max_pinned
        if isinstance(value, str):
            return None if capacity is None else int(capacity * float(value[:-1]) / 100)
        return int(value)


class UCMConfig(_Strict):
    tiers: list[TierConfig] = Field(min_length=1, description="the tier stack, fastest first")
    durability: Durability = Field(
        default="local", description="when a store completes: in the first tier (memory), "
        "on the first persistent tier (local), on every tier (all)")
    namespace: str = Field(default="default", min_length=1,
                           description="names the cache: in every block and storage path "
                           f"(at most {MAX_NAMESPACE_BYTES} bytes as UTF-8)")
    inbox_size: int = Field(default=4096, ge=1,
                            description="events outstanding before submit fails with KernelBusy")
    deadline: float = Field(default=30.0, gt=0,
                            description="seconds an event may take unless it sets its own: "
                            "every event is bounded")
    pin_ttl: float = Field(default=60.0, gt=0,
                           description="seconds a pinning lookup keeps its blocks from eviction")
    eviction: Literal["shadow", "s3fifo", "lru", "adaptive"] = Field(
        default="shadow", description="each tier's eviction policy: shadow (two LRU segments, "
        "blocks stored once and blocks used again, whose eviction weight sampled miniature "
        "caches choose; never below LRU on the Mooncake conversation trace, see "
        "docs/autotune.md), s3fifo, lru, or adaptive (S3-FIFO whose small-queue share follows "
        "its ghost hits, as ARC's split does)")
    promote: bool = Field(default=True, description="copy hits from slower tiers upwards")
    sessions: SessionsConfig = Field(default_factory=SessionsConfig,
                                     description="session holds: blocks a session keeps in "
                                     "the fastest tier between its requests (docs/vllm.md, "
                                     "Sessions)")
    threads: ThreadsConfig = Field(default_factory=ThreadsConfig,
                                   description="the threads the kernel owns and lends to its "
                                   "drivers")
    codec: CodecName = Field(
        default="none", description="the codec of every tier that sets no `codec` of its own "
        "(see tiers[].codec and docs/compression.md)")
    mrc: MRCConfig | None = Field(default=None,
                                  description="a sampled miss-ratio curve per tier, for its "
                                  "policy, exported as ucm_mrc_* metrics (docs/autotune.md); "
                                  "null: off, {} on with the defaults")
    trace: TraceConfig | None = Field(default=None,
                                      description="record every event's life; null: off "
                                      "(unless UCM_TRACE names a directory)")

    @field_validator("namespace")
    @classmethod
    def _namespace_bytes(cls, namespace: str) -> str:
        size = len(namespace.encode())
        if size > MAX_NAMESPACE_BYTES:  # a file name and a block header field hold it
            raise ValueError(f"is {size} bytes as UTF-8; the limit is {MAX_NAMESPACE_BYTES}")
        return namespace

    @model_validator(mode="after")
    def _tier_codecs(self) -> UCMConfig:
        """Every tier's codec set: its own, else the top-level one."""
        if all(t.codec is not None for t in self.tiers):
            return self
        tiers = [t if t.codec is not None else t.model_copy(update={"codec": self.codec})
                 for t in self.tiers]
        return self.model_copy(update={"tiers": tiers})

    @model_validator(mode="after")
    def _unique_tier_names(self) -> UCMConfig:
        names = [t.name or t.driver for t in self.tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tier names must be unique; give 'name' to: {', '.join(dupes)}")
        return self


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ucm"


def default_config() -> dict[str, Any]:
    """The embedded default: 1 GiB of memory over 20 GiB in the user's cache directory."""
    return {
        "tiers": [
            {"driver": "memory", "capacity": "1GiB"},
            {"driver": "posix", "path": str(default_cache_dir() / "blocks"), "capacity": "20GiB"},
        ]
    }


def config_fingerprint(config: UCMConfig) -> str:
    """A digest of everything in `config`, secret values included, for telling configs apart
    (two that differ only in a password differ here) without showing any secret. Keyed with
    this process's random key: equal within a process, not comparable between processes."""
    text = json.dumps(config.model_dump(), sort_keys=True, default=_reveal)
    return hashlib.blake2b(text.encode(), key=_FINGERPRINT_KEY, digest_size=32).hexdigest()


_FINGERPRINT_KEY = secrets.token_bytes(32)  # a digest of a weak password cannot be brute-forced


def _reveal(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return {"secret": value.get_secret_value()}
    if isinstance(value, SecretBytes):
        return {"secret": value.get_secret_value().hex()}
    if isinstance(value, BaseModel):  # a model inside a driver's options
        return value.model_dump()
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    return str(value)  # paths


def format_errors(exc: ValidationError, *, root: str = "",
                  retired: Mapping[tuple[str, ...], str] | None = None) -> str:
    """A ValidationError of a config model as one line per error, "key.path: problem", under
    `root` (where the model sits, e.g. the engine option holding it; "" for a ucm config).
    Unknown keys say so; a key of an earlier schema (`retired`: the end of its path, list
    indices left out; default RETIRED_KEYS, the ucm config's, wherever a ucm config sits) also
    says what replaces it. Values are never echoed: a rejected value may be a secret."""
    retired = RETIRED_KEYS if retired is None else retired
    lines = []
    for err in exc.errors():
        path = [str(p) for p in err["loc"] if p != "options"]
        loc = ".".join([root, *path] if root else path) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            keys = tuple(p for p in path if not p.isdigit())
            hint = next((retired[keys[i:]] for i in range(len(keys)) if keys[i:] in retired),
                        None)
            msg = "unknown key" if hint is None else f"not a key; {hint}"
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)


def load_config(source: UCMConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
                ) -> UCMConfig:
    """Builds a UCMConfig from a config object, a dict, a .yaml/.yml/.json path, or None."""
    if isinstance(source, UCMConfig):
        return source
    if source is None:
        data: Any = default_config()
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        path = Path(source)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        if path.suffix == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}: invalid JSON: {exc}") from None
        else:
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: invalid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: the top level must be a mapping")
    try:
        return UCMConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc)) from None
