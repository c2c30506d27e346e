"""The ZeroMQ sockets of a publishing instance: PUB for batches, ROUTER for snapshot requests.

Both are bound at construction (an endpoint in use raises ``ValueError`` naming it, and nothing
stays bound) and used from the sink's publisher thread only: sends never block (PUB
drops at its high-water mark, as ZeroMQ does for slow subscribers; they then see a gap and ask
for a snapshot).
"""

from __future__ import annotations

import zmq

from kvtier.events.config import EventsConfig

__all__ = ["Publisher"]

# Requests served per poll: a burst of subscribers cannot stall a scheduler step for long.
MAX_REQUESTS_PER_POLL = 8
# How long close() lets the last batch (AllBlocksCleared) leave before dropping it.
CLOSE_LINGER_MS = 200
_SNDMORE, _EVENTS, _POLLIN = int(zmq.SNDMORE), int(zmq.EVENTS), int(zmq.POLLIN)


class Publisher:
    """PUB (and ROUTER) sockets bound on ``config``'s endpoints.

    Attributes:
        endpoint, snapshot_endpoint: the bound addresses (an ephemeral port resolved).
    """

    def __init__(self, config: EventsConfig, context: zmq.Context | None = None) -> None:
        self._own_context = context is None
        self.ctx = context if context is not None else zmq.Context()
        self.topic = config.topic.encode("utf-8")
        self.pub: zmq.Socket | None = None
        self.router: zmq.Socket | None = None
        try:
            self.pub = self.ctx.socket(zmq.PUB)
            # A bounded linger: a sink dropped without close() must not hang context teardown.
            self.pub.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
            self.pub.setsockopt(zmq.SNDHWM, config.hwm)
            self.endpoint = _bind(self.pub, config.endpoint, "endpoint")
            self.snapshot_endpoint = None
            if config.snapshot_endpoint is not None:
                self.router = self.ctx.socket(zmq.ROUTER)
                self.router.setsockopt(zmq.LINGER, 0)
                self.snapshot_endpoint = _bind(
                    self.router, config.snapshot_endpoint, "snapshot_endpoint"
                )
        except BaseException:
            self.close(linger_ms=0)
            raise

    def send(self, frames: tuple[bytes, bytes]) -> None:
        """Publish one message: ``(sequence frame, payload)`` after the topic."""
        # Frame by frame with int flags: a third of send_multipart's cost for small messages.
        pub = self.pub
        pub.send(self.topic, _SNDMORE)
        pub.send(frames[0], _SNDMORE)
        pub.send(frames[1])

    def requests(self) -> list[list[bytes]]:
        """Snapshot requests waiting on the ROUTER socket (identity frame first), at most
        ``MAX_REQUESTS_PER_POLL``; never blocks."""
        out: list[list[bytes]] = []
        router = self.router
        if router is None:
            return out
        while len(out) < MAX_REQUESTS_PER_POLL and router.getsockopt(_EVENTS) & _POLLIN:
            out.append(router.recv_multipart(zmq.NOBLOCK))
        return out

    def reply(self, frames: list[bytes]) -> None:
        # A peer gone in the meantime is not an error: ROUTER drops unroutable replies.
        self.router.send_multipart(frames, zmq.NOBLOCK)

    def close(self, linger_ms: int = CLOSE_LINGER_MS) -> None:
        for sock in (self.pub, self.router):
            if sock is not None:
                sock.close(linger=linger_ms)
        self.pub = self.router = None
        if self._own_context:
            self.ctx.term()


def _bind(sock: zmq.Socket, endpoint: str, name: str) -> str:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        if e.errno == zmq.EADDRINUSE:
            raise ValueError(f"{name}: {endpoint!r} is already in use ({e})") from e
        raise ValueError(f"{name}: cannot bind {endpoint!r} ({e})") from e
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
