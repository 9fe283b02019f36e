"""Session holds on one tier: a session keeps a set of block keys from eviction for
`retain_s` seconds (between its requests, say while a person types or a tool runs).

A held key is skipped by the tier's policy as a pinned one is (`Policy.held`), whether the
block is in the tier already or arrives later. The bytes held are capped (`sessions.max_pinned`):
a hold, or a held block's arrival, that goes over the cap releases the oldest holds first.
Holds end on `release` (the session's `end`), on expiry (checked before each eviction and each
hold), or over the cap; each way is counted in the kernel's statistics as
`session_releases.<reason>`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ucm.kernel._policy import Policy


@dataclass
class _Hold:
    keys: set[bytes]
    expires: float


class Holds:
    def __init__(self, policy: Policy, cap: int | None, stats: Counter[str], *,
                 clock: Callable[[], float]) -> None:
        self.policy = policy
        self.cap = cap  # held bytes at most (None: no cap)
        self.stats = stats
        self._clock = clock
        self._sessions: OrderedDict[str, _Hold] = OrderedDict()  # oldest hold first
        self._held: Counter[bytes] = Counter()  # key -> sessions holding it
        self._next_expiry = float("inf")
        self.held_bytes = 0  # bytes of the held keys the tier holds
        policy.held = self._held

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: str) -> bool:
        return session in self._sessions

    def keys_of(self, session: str) -> set[bytes]:
        hold = self._sessions.get(session)
        return set(hold.keys) if hold else set()

    def added(self, key: bytes, old: int | None) -> None:
        """The tier indexed `key` (it held `old` bytes of it before, None: not at all)."""
        if key in self._held:
            self.held_bytes += (self.policy.size_of(key) or 0) - (old or 0)
            self._enforce_cap()

    def removed(self, key: bytes, size: int) -> None:
        """The tier dropped `key` (`size` bytes of it)."""
        if key in self._held:
            self.held_bytes -= size

    def hold(self, session: str, keys: Sequence[bytes], retain_s: float) -> int:
        """Holds `keys` for `session` until `retain_s` from now (a session's later hold adds
        its keys and restarts the time, and makes it the newest). Returns the keys the session
        holds; 0 when the cap released it at once (its blocks alone are over the cap)."""
        self.expire()
        hold = self._sessions.pop(session, None)
        if hold is None:
            hold = _Hold(set(), 0.0)
        new = [k for k in dict.fromkeys(keys) if k not in hold.keys]
        hold.keys.update(new)
        size_of = self.policy.size_of
        self.held_bytes += sum(size_of(k) or 0 for k in new if k not in self._held)
        self._held.update(new)
        hold.expires = self._clock() + retain_s
        self._sessions[session] = hold
        self._next_expiry = min(self._next_expiry, hold.expires)
        self.stats["session_holds"] += 1
        self._enforce_cap()
        return len(hold.keys) if session in self._sessions else 0

    def release(self, session: str, reason: str = "end") -> bool:
        """Ends `session`'s hold; False when it holds nothing here."""
        hold = self._sessions.pop(session, None)
        if hold is None:
            return False
        size_of = self.policy.size_of
        for key in hold.keys:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
                self.held_bytes -= size_of(key) or 0
        self.stats[f"session_releases.{reason}"] += 1
        if hold.expires <= self._next_expiry:
            self._next_expiry = min((h.expires for h in self._sessions.values()),
                                    default=float("inf"))
        return True

    def expire(self) -> None:
        """Releases the holds whose time has passed (cheap while none has)."""
        now = self._clock()
        if now < self._next_expiry:
            return
        for session, hold in list(self._sessions.items()):
            if hold.expires <= now:
                self.release(session, "expired")

    def _enforce_cap(self) -> None:
        if self.cap is None:
            return
        while self._sessions and self.held_bytes > self.cap:
            self.release(next(iter(self._sessions)), "cap")
