"""Graceful shutdown of `matrixinfer serve` on SIGTERM (what systemd, Docker and Kubernetes
send) or SIGINT: drain, then exit 0.

1. The first signal starts the drain: from then on every new HTTP request (health checks
   included, so load balancers stop routing here) gets 503 with Retry-After.
2. Requests in flight, streams included, run to their end, for at most `--shutdown-timeout`.
3. Then uvicorn stops (anything still running is cut after a short grace), the app's
   lifespan shuts the engine down, and the process exits 0. A second signal exits at once.

uvicorn alone would close its listening socket (new clients get "connection refused", not
an answer) and re-raise the signal after its own drain (exit status 143, skipping the code
after `run`): `DrainingServer` replaces its signal handling for that.
"""

from __future__ import annotations

import math
import threading
import time

import uvicorn
from starlette.responses import JSONResponse

UNDRAINED_PATHS = ("/metrics",)  # the scraper may still read the last numbers


class Drain:
    """Shared by the middleware (counts requests, refuses new ones) and the server."""

    def __init__(self):
        self.deadline: float | None = None  # monotonic time the drain gives up; None: serving
        self.active = 0  # HTTP requests whose response (a whole stream) is not finished
        self._lock = threading.Lock()

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def start(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s

    def retry_after(self) -> int:
        return max(1, math.ceil((self.deadline or 0) - time.monotonic()) + 1)

    def wait_idle(self) -> None:
        """Until no request is in flight or the deadline passed."""
        while self.active and time.monotonic() < self.deadline:
            time.sleep(0.05)


class DrainMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware): a streamed response counts until its last chunk."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNDRAINED_PATHS:
            return await self.app(scope, receive, send)
        if self.drain.draining:
            body = {"error": {"message": "the server is shutting down; retry later or on another replica",
                              "type": "server_error", "param": None, "code": "server_shutting_down"}}
            resp = JSONResponse(body, status_code=503, headers={"Retry-After": str(self.drain.retry_after()),
                                                                "Connection": "close"})
            return await resp(scope, receive, send)
        with self.drain._lock:
            self.drain.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            with self.drain._lock:
                self.drain.active -= 1


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout_s: float):
        super().__init__(config)
        self.drain, self.shutdown_timeout_s = drain, shutdown_timeout_s

    def handle_exit(self, sig, frame) -> None:
        if self.drain.draining:  # asked twice: stop now
            self.should_exit = self.force_exit = True
            return
        self.drain.start(self.shutdown_timeout_s)
        threading.Thread(target=self._exit_when_drained, name="drain", daemon=True).start()

    def _exit_when_drained(self) -> None:
        self.drain.wait_idle()
        self.should_exit = True  # uvicorn's loop sees it within 0.1 s; lifespan shutdown follows
