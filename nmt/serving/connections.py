"""Connections that send no request: closed after a deadline, and capped in number.

uvicorn waits for ever for a new connection's first request head, and a client that trickles a
head a byte at a time keeps resetting its keep-alive timer: idle sockets would hold the server's
places. Here a connection without a request in progress is closed once ``idle_timeout`` seconds
pass without a new request head (counted from its opening, then from each answer); a request in
progress is bounded by the body and request timeouts instead. Beyond ``most_open`` connections the
oldest one without a request in progress is closed (the newcomer when every one has one), so a
client that keeps reopening idle sockets cannot lock the others out: the requests in progress,
which hold memory, are capped apart (the server's --max-connections, answered with a JSON 503).
"""

from __future__ import annotations

import asyncio


def with_idle_deadline(base: type[asyncio.Protocol], idle_timeout: float, most_open: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class ``base`` (its ``cycle`` is the request being answered, or the last)
    with the deadline and the cap."""

    class Protocol(base):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self.idle_since_cycle = None  # the request being answered when the deadline was set
            self.deadline = None
            self.opened = asyncio.get_running_loop().time()
            if len(self.connections) > most_open:
                idle = [other for other in self.connections if other is not self and not other.answering()
                        and not other.transport.is_closing()]
                if not idle:
                    transport.close()
                    return
                min(idle, key=lambda other: other.opened).transport.close()
            self.set_deadline()

        def answering(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def set_deadline(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.idle_since_cycle = self.cycle
            self.deadline = asyncio.get_running_loop().call_later(idle_timeout, self.close_if_idle)

        def close_if_idle(self) -> None:
            if self.answering() or self.cycle is not self.idle_since_cycle:  # a request came: wait from its answer
                self.set_deadline()
            elif not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.set_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

    return Protocol
