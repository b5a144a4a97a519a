"""The listening TCP socket, bound by mlxcel itself and handed to uvicorn.

Binding here rather than inside uvicorn lets the socket carry b10621's options (SO_REUSEADDR
always, SO_REUSEPORT with --reuse-port) and lets a bind failure stop startup with one line
before the model load starts. A --host ending in .sock is left to uvicorn (a Unix socket has
no port to share).

Entry point: `bind_listener(host, port, reuse_port)` returns a bound, listening socket or
raises `StartupRefusal`.
"""

from __future__ import annotations

import errno
import socket

from mlxcel.config.refusal import StartupRefusal

BACKLOG = 2048  # uvicorn's own default


def bind_listener(host: str, port: int, reuse_port: bool) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupRefusal(f"couldn't resolve --host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        hint = ""
        if e.errno == errno.EADDRINUSE:
            hint = ("; another process holds it (servers meant to share a port must all start "
                    "with --reuse-port)" if not reuse_port else "; the process holding it did not set SO_REUSEPORT")
        raise StartupRefusal(f"couldn't bind HTTP server socket, hostname: {host}, port: {port}: "
                             f"{e.strerror}{hint}") from None
    sock.set_inheritable(False)
    return sock


def bound_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]
