from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import trio


@pytest.fixture
def hold_trio_thread() -> Iterator[Callable]:
    """hold(kernel) keeps the kernel's trio thread busy until the `release()` it returns (or
    the test's end): whatever still needs the trio thread waits meanwhile."""
    held: list[tuple[threading.Thread, threading.Event]] = []

    def hold(kernel) -> Callable[[], None]:
        busy, release = threading.Event(), threading.Event()

        def block() -> None:
            busy.set()
            release.wait(10)

        holder = threading.Thread(target=trio.from_thread.run_sync, args=(block,),
                                  kwargs={"trio_token": kernel._token})
        holder.start()
        assert busy.wait(10)
        held.append((holder, release))

        def let_go() -> None:
            release.set()
            holder.join(10)

        return let_go

    yield hold
    for holder, release in held:
        release.set()
        holder.join(10)
