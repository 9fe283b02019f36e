"""Real English text already on every machine: the license texts, READMEs and long docstrings of
installed Python packages, for prompts and perplexity measurements on a real trained model.

    docs = documents(min_chars=4000, limit=60)   # [(name, text)], the same list on every call

The order is deterministic (sorted by distribution name, then file), so two runs of a benchmark
on one machine use the same texts. Texts with a low share of letters (tables, code dumps) or
mostly non-ASCII are left out: they say little about a chat model's quality.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re

_CANDIDATES = re.compile(r"(^|/)(LICEN[CS]E|COPYING|README|NOTICE|AUTHORS)[^/]*$", re.I)
_WS = re.compile(r"[ \t]+")


def _prose_like(text: str) -> bool:
    if not text:
        return False
    ascii_share = sum(c.isascii() for c in text) / len(text)
    letters = sum(c.isalpha() for c in text) / len(text)
    return ascii_share > 0.98 and letters > 0.6


def _clean(text: str) -> str:
    lines = [_WS.sub(" ", line).strip() for line in text.splitlines()]
    out = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", out).strip()


def documents(*, min_chars: int = 2000, max_chars: int = 40000, limit: int | None = None,
              ) -> list[tuple[str, str]]:
    """Distinct prose documents from installed distributions, each cut to `max_chars`."""
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    dists = sorted(metadata.distributions(),
                   key=lambda d: ((d.metadata["Name"] or "").lower(), d.version or ""))
    for dist in dists:
        name = dist.metadata["Name"] or "?"
        bodies: list[tuple[str, str]] = []
        description = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") \
            else None
        if isinstance(description, str):
            bodies.append((f"{name}:README", description))
        for file in sorted(dist.files or [], key=str):
            if _CANDIDATES.search(str(file)):
                try:
                    bodies.append((f"{name}:{file}", file.read_text(encoding="utf-8")))
                except (OSError, UnicodeDecodeError, ValueError):
                    continue
        for label, raw in bodies:
            text = _clean(raw)[:max_chars]
            key = text[:400]
            if len(text) < min_chars or key in seen or not _prose_like(text):
                continue
            seen.add(key)
            out.append((label, text))
            if limit is not None and len(out) >= limit:
                return out
    return out


if __name__ == "__main__":
    for label, text in documents(min_chars=4000):
        print(f"{len(text):7d}  {label}")
