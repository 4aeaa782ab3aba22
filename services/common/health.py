"""``grpc.health.v1.Health`` that never sends while holding its registry lock.

grpcio-health-checking's `HealthServicer` (non-blocking Watch, its default) sends each watcher its
update inside the servicer's lock, and a send waits until the write completes. That completion is
processed by the server's single event thread, which also runs the close callback of a watcher
that hangs up, and that callback takes the same lock. When a watcher leaves while `set` is sending
to another (every `wait_healthy` caller hangs up the moment it sees SERVING, so a restart watched
by two callers is enough), both threads wait on each other: the server freezes, every call on it
hangs, and the process looks alive. A chaos run saw a restarted trainer take Offers that never
reached their handler. Its blocking Watch avoids the lock but holds a pool thread per watcher,
so a few dozen watchers (or one client opening them) would take every thread of the server.

Here the registry lock only guards the statuses and the watchers; sends happen outside it, each
watcher's under its own lock, and each send reads the status current at that moment, so a watcher
sees every change in order and its last message is the current status. The close callback takes
only the registry lock. Check and Watch behave as grpcio's (SERVICE_UNKNOWN for an unknown watched
service, NOT_FOUND for an unknown checked one), and so does `enter_graceful_shutdown`.
"""

from __future__ import annotations

import threading
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_Send = Callable[[health_pb2.HealthCheckResponse | None], None]


class _Watcher:
    __slots__ = ("send", "lock", "closed")

    def __init__(self, send: _Send) -> None:
        self.send = send
        self.lock = threading.Lock()  # one send at a time, and in the order the statuses changed
        self.closed = False


class HealthServicer(health_pb2_grpc.HealthServicer):
    """The health service of a `GrpcServer` (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._watchers: dict[str, set[_Watcher]] = {}
        self._shutting_down = False

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext,
              send_response_callback: _Send | None = None) -> None:
        watcher = _Watcher(send_response_callback)
        service = request.service
        with self._lock:
            self._watchers.setdefault(service, set()).add(watcher)
        if not context.add_callback(lambda: self._leave(watcher, service)):
            self._leave(watcher, service)  # the RPC already ended: no callback will come
            return
        self._notify(watcher, service)

    Watch.experimental_non_blocking = True  # grpc passes send_response_callback; no thread is held

    def set(self, service: str, status: int) -> None:
        """Record ``service``'s status and send it to its watchers (ignored after shutdown began)."""
        with self._lock:
            if self._shutting_down:
                return
            self._status[service] = status
            watchers = list(self._watchers.get(service, ()))
        for watcher in watchers:
            self._notify(watcher, service)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good: later `set` calls are ignored."""
        with self._lock:
            if self._shutting_down:
                return
            self._shutting_down = True
            for service in self._status:
                self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
            watched = [(w, s) for s, ws in self._watchers.items() for w in ws]
        for watcher, service in watched:
            self._notify(watcher, service)

    def _notify(self, watcher: _Watcher, service: str) -> None:
        with watcher.lock:
            if watcher.closed:
                return
            with self._lock:
                status = self._status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            watcher.send(health_pb2.HealthCheckResponse(status=status))

    def _leave(self, watcher: _Watcher, service: str) -> None:
        """The RPC ended (the watcher hung up, or the server stops): runs on the server's event
        thread, so it must not wait for a send (module docstring)."""
        with self._lock:
            self._watchers.get(service, set()).discard(watcher)
        watcher.closed = True
        watcher.send(None)
