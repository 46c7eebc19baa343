"""A TCP proxy between the agents and the control plane that a test can cut, as a network fault
would: ``cut`` closes every connection through it at once, both ends, and new ones go through as
before. Threads and plain sockets: it stands for the network, not for any part of odmoe."""

from __future__ import annotations

import contextlib
import socket
import threading


class LinkCut:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.cuts = 0
        threading.Thread(target=self._accept, name="link-cut", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                far = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:  # the server is down: as if the connection were refused
                near.close()
                continue
            far.settimeout(None)
            with self._lock:
                self._open.update((near, far))
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                self._drop(end)

    def _drop(self, end: socket.socket) -> None:
        with self._lock:
            self._open.discard(end)
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)
        end.close()

    def cut(self) -> int:
        """Close every connection through the proxy now; returns how many there were (both ends counted once)."""
        with self._lock:
            ends = list(self._open)
        for end in ends:
            self._drop(end)
        self.cuts += 1
        return len(ends) // 2

    def close(self) -> None:
        self._listener.close()
        self.cut()
