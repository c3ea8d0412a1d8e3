"""Wire format shared by every EMS role: one frame = fixed prefix + JSON header + raw payload.

    !IQ  (header length, payload length)  |  header (UTF-8 JSON)  |  payload (bytes)

The header carries the operation and metadata; values travel as raw payload bytes so a
4 MiB value costs no encoding, and the receiver can `recv_into` its final destination
(the MP server receives a put straight into its DRAM arena).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import struct
import threading
import time
from typing import Callable, Iterable

PREFIX = struct.Struct("!IQ")
MAX_HEADER = 16 << 20
MAX_PAYLOAD = 1 << 40


class EMSError(Exception):
    """A request the pool refused (bad input, value too large, unknown namespace...)."""


class ProtocolError(EMSError):
    """The peer sent something that is not a frame."""


def wire_key(key: str | bytes) -> str:
    """Keys are str or bytes; on the wire both are a latin-1 str of the key's bytes."""
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise EMSError(f"key must be str or bytes, not {type(key).__name__}")
    if len(key) == 0:
        raise EMSError("key must not be empty")
    if len(key) > 4096:
        raise EMSError("key longer than 4096 bytes")
    return bytes(key).decode("latin-1")


def as_buffer(value) -> memoryview:
    """A flat byte view of bytes, bytearray, numpy arrays, torch tensors... without copying."""
    if hasattr(value, "untyped_storage") and hasattr(value, "is_contiguous"):  # torch.Tensor
        if value.device.type != "cpu":
            value = value.cpu()
        if not value.is_contiguous():
            value = value.contiguous()
        value = value.view(-1).view(__import__("torch").uint8).numpy()
    try:
        mv = memoryview(value)
    except TypeError:
        raise EMSError(f"value must support the buffer protocol, not {type(value).__name__}") from None
    if not mv.c_contiguous:
        raise EMSError("value buffer must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def encode_prefix(header: dict, payload_len: int) -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(len(h), payload_len) + h


def send_frame(sock: socket.socket, header: dict, buffers: Iterable = ()) -> None:
    bufs = [b for b in buffers if len(b)]
    total = sum(len(b) for b in bufs)
    head = encode_prefix(header, total)
    if not bufs or total < 65536:
        sock.sendall(b"".join([head, *bufs]))  # small: one syscall
        return
    sock.sendall(head)
    for b in bufs:
        sock.sendall(b)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return buf


def recv_header(sock: socket.socket) -> tuple[dict, int]:
    """Read one frame's header; the caller reads exactly `payload_len` bytes after it."""
    hlen, plen = PREFIX.unpack(recv_exact(sock, PREFIX.size))
    if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
        raise ProtocolError(f"frame too large (header {hlen}, payload {plen})")
    try:
        header = json.loads(recv_exact(sock, hlen))
    except ValueError as e:
        raise ProtocolError(f"bad header: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not an object")
    return header, plen


def recv_frame(sock: socket.socket) -> tuple[dict, bytearray]:
    header, plen = recv_header(sock)
    return header, recv_exact(sock, plen)


def drain(sock: socket.socket, n: int) -> None:
    """Discard a payload we refused, so the connection stays in sync."""
    chunk = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n > 0:
        k = min(n, len(chunk))
        recv_exact_into(sock, chunk[:k])
        n -= k


def split_payload(payload, lengths: list[int]) -> list[memoryview]:
    mv, out, pos = memoryview(payload), [], 0
    for n in lengths:
        out.append(mv[pos : pos + n])
        pos += n
    return out


def decode_get_reply(reply: dict, payload) -> list[tuple[memoryview | None, list | None]]:
    """Per key of a get_many reply: (value bytes sent inline, or None; arena location, or None)."""
    views = iter(split_payload(payload, [n for n in reply["lens"] if n >= 0]))
    return [(next(views) if n >= 0 else None, loc) for loc, n in zip(reply["locs"], reply["lens"])]


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise EMSError(f"address must be HOST:PORT, got {addr!r}")
    return host or "127.0.0.1", int(port)


def ns_create_header(name: str, dram_bytes: int | None = None, ssd_bytes: int | None = None,
                     replicas: int | None = None, if_absent: bool = False) -> dict:
    """The controller's `ns_create` request (None: not given, so an implicit creation)."""
    return {"op": "ns_create", "name": name, "dram_bytes": dram_bytes, "ssd_bytes": ssd_bytes,
            "replicas": replicas, "if_absent": if_absent}


# -- server side --------------------------------------------------------------------------

Handler = Callable[[dict, int, socket.socket], tuple]


class RPCServer:
    """Threaded TCP server: one thread per connection, requests on a connection in order.

    `handler(header, payload_len, sock)` must consume the payload from `sock` and returns
    (reply header, reply buffers[, done]); `done()` runs once the buffers are on the wire
    (the MP server unpins arena blocks there). Threads are fine here: socket I/O and memcpy release the GIL.
    """

    def __init__(self, host: str, port: int, handler: Handler):
        self.handler = handler
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=256)
        self.host, self.port = self.sock.getsockname()[:2]
        self._stop = threading.Event()
        self._busy = threading.Condition()
        self._active = 0  # requests being handled (idle connections are not counted)
        self.closed = False

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                break
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    header, plen = recv_header(conn)
                except (ConnectionError, OSError, ProtocolError):
                    return
                with self._busy:
                    if self._stop.is_set():
                        return  # draining: no new requests; the client sees a gone server (a miss)
                    self._active += 1
                try:
                    self._serve_one(conn, header, plen)
                except OSError:
                    return
                finally:
                    with self._busy:
                        self._active -= 1
                        self._busy.notify_all()

    def _serve_one(self, conn: socket.socket, header: dict, plen: int) -> None:
        done = None
        try:
            reply, bufs, *rest = self.handler(header, plen, conn)
            done = rest[0] if rest else None
        except EMSError as e:
            reply, bufs = {"ok": False, "error": str(e)}, []
        try:
            send_frame(conn, reply, bufs)
        finally:
            if done:
                done()

    def stop(self) -> None:
        """Stop accepting connections and requests; requests being handled go on."""
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes an accept() blocked in another thread
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def close(self, drain_s: float = 0.0) -> None:
        """stop(), then wait up to `drain_s` for the requests being handled to finish."""
        self.closed = True
        self.stop()
        deadline = time.monotonic() + drain_s
        with self._busy:
            while self._active and (left := deadline - time.monotonic()) > 0:
                self._busy.wait(left)


def serve_until_signal(serve: Callable[[], None], stop: Callable[[], None], close: Callable[[], None]) -> int:
    """Run a role's accept loop; SIGTERM/SIGINT stop it (no new requests), then `close` lets
    the requests in flight finish and shuts down cleanly (log synced, arena unlinked): exit 0."""
    signal.signal(signal.SIGTERM, lambda *_: stop())
    signal.signal(signal.SIGINT, lambda *_: stop())
    try:
        serve()
    finally:
        close()
    return 0


# -- client side --------------------------------------------------------------------------


class Connection:
    """One blocking connection to a server; thread-safe (requests are serialised)."""

    def __init__(self, addr: tuple[str, int], timeout_s: float):
        self.addr, self.timeout_s = addr, timeout_s
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        s = socket.create_connection(self.addr, timeout=self.timeout_s)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def call(self, header: dict, buffers: Iterable = (), into=None) -> tuple[dict, object]:
        """Send one request, return (reply header, payload). Raises OSError if the server is gone.

        `into(reply, payload_len, sock)` may read the payload itself (e.g. into a tensor).
        """
        with self.lock:
            if self.sock is None:
                self.sock = self._connect()
            try:
                send_frame(self.sock, header, buffers)
                reply, plen = recv_header(self.sock)
                payload = into(reply, plen, self.sock) if into else recv_exact(self.sock, plen)
            except BaseException:
                self.close_locked()  # the stream is out of sync; never reuse it
                raise
        if reply.get("ok") is False:
            raise EMSError(reply.get("error", "request failed"))
        return reply, payload

    def close_locked(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def close(self) -> None:
        with self.lock:
            self.close_locked()


def call_once(addr: str, header: dict, timeout_s: float = 5.0) -> dict:
    conn = Connection(parse_addr(addr), timeout_s)
    try:
        return conn.call(header)[0]
    finally:
        conn.close()


# -- asyncio side -------------------------------------------------------------------------


async def async_recv_frame(reader: asyncio.StreamReader) -> tuple[dict, bytes]:
    hlen, plen = PREFIX.unpack(await reader.readexactly(PREFIX.size))
    if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
        raise ProtocolError(f"frame too large (header {hlen}, payload {plen})")
    header = json.loads(await reader.readexactly(hlen))
    payload = await reader.readexactly(plen) if plen else b""
    return header, payload


def async_send_frame(writer: asyncio.StreamWriter, header: dict, buffers: Iterable = ()) -> None:
    bufs = [b for b in buffers if len(b)]
    writer.write(encode_prefix(header, sum(len(b) for b in bufs)))
    for b in bufs:
        writer.write(b)
