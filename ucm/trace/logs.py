"""Log lines that carry the trace's ids, so a log line and a trace record can be matched.

    log = event_logger(logging.getLogger("ucm.vllm_hook"), event_id=7, request_id="req-1")
    log.warning("load failed")   # -> "[ev=7 req=req-1] load failed"; record.ucm_event_id == 7
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any


class EventLogAdapter(logging.LoggerAdapter):
    """Prefixes messages with `[ev=<event id> req=<request id>]` and sets `ucm_event_id` and
    `ucm_request_id` on each LogRecord (for structured formatters)."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        extra = self.extra or {}
        event_id = extra.get("event_id")
        request_id = extra.get("request_id")
        parts = []
        if event_id is not None:
            parts.append(f"ev={event_id}")
        if request_id is not None:
            parts.append(f"req={request_id}")
        merged = dict(kwargs.get("extra") or {})
        merged.setdefault("ucm_event_id", event_id)
        merged.setdefault("ucm_request_id", request_id)
        kwargs["extra"] = merged
        return (f"[{' '.join(parts)}] {msg}" if parts else msg), kwargs


def event_logger(logger: logging.Logger, *, event_id: int | None = None,
                 request_id: str | None = None) -> EventLogAdapter:
    return EventLogAdapter(logger, {"event_id": event_id, "request_id": request_id})
