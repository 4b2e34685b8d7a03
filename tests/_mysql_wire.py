"""A TCP proxy between a MySQL client and MariaDB that counts the client's commands.

Every command a MySQL client sends starts a new packet sequence: its first packet
carries sequence id 0. The other client packets carry a higher id: the handshake
response (1), an authentication switch's answer, the continuation of a command
longer than 16 MiB. So the client packets with id 0 are exactly the commands, one
round trip each (the client waits for the server's answer before it sends the
next one; several statements in one ``COM_QUERY`` are one packet, one round trip).
The proxy parses the client's stream packet by packet (header: 3 bytes of length,
1 byte of sequence id), without TLS or compression, which the store's tests do not
use.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field
from typing import Self

__all__ = ["COM_QUERY", "COM_QUIT", "CommandCounter", "Link"]

COM_QUIT = 0x01
COM_QUERY = 0x03
_KEPT = 1 << 16  # bytes kept of each command


@dataclass
class Link:
    """One client connection through the proxy: the commands it sent, in order (each
    as its first 64 KiB, the command byte first), and whether it ended."""

    commands: list[bytes] = field(default_factory=list)
    closed: bool = False


class CommandCounter:
    """Listens on a loopback port; each connection is relayed to ``port``."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.links: list[Link] = []
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> Self:
        self._accepting.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        self.listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._accepting.join(10)

    def url(self, url: str) -> str:
        """``url`` (a ``mysql://`` URL of the target) with the proxy's port instead."""
        return url.replace(f":{self.target[1]}/", f":{self.port}/", 1)

    def commands(self) -> int:
        """How many commands every client sent so far."""
        with self._lock:
            return sum(len(link.commands) for link in self.links)

    def sent(self) -> list[bytes]:
        """Every command so far, in the order each connection sent them."""
        with self._lock:
            return [c for link in self.links for c in link.commands]

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            link = Link()
            with self._lock:
                self.links.append(link)
                self._sockets += [client, server]
            threading.Thread(target=self._upward, args=(client, server, link), daemon=True).start()
            threading.Thread(target=self._downward, args=(server, client), daemon=True).start()

    def _upward(self, client: socket.socket, server: socket.socket, link: Link) -> None:
        """Relay the client's bytes, noting each packet of sequence id 0."""
        header = b""  # the current packet's header, while incomplete
        left = 0  # bytes of the current packet's payload still to come
        head: bytearray | None = None  # a command's first bytes, while it arrives
        try:
            while data := client.recv(1 << 16):
                i = 0
                while i < len(data):
                    if left == 0 and head is None:
                        take = data[i : i + 4 - len(header)]
                        header += take
                        i += len(take)
                        if len(header) < 4:
                            break
                        left = int.from_bytes(header[:3], "little")
                        head = bytearray() if header[3] == 0 else None
                        header = b""
                    n = min(left, len(data) - i)
                    if head is not None and len(head) < _KEPT:
                        head += data[i : i + min(n, _KEPT - len(head))]
                    left -= n
                    i += n
                    if left == 0:
                        if head is not None:
                            with self._lock:
                                link.commands.append(bytes(head))
                        head = None
                server.sendall(data)
        except OSError:
            pass
        finally:
            link.closed = True
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_WR)

    @staticmethod
    def _downward(server: socket.socket, client: socket.socket) -> None:
        try:
            while data := server.recv(1 << 16):
                client.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)
