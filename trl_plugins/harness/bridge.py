"""The one way out of an isolated harness's network namespace: a TCP port on the namespace's loopback joined, through a
Unix socket in the trajectory's working directory (a file, which crosses namespaces), to the endpoint's TCP port on the
host's loopback. Nothing else is reachable from inside: the namespace has its own loopback and no other interface.

Host side: :class:`UnixToTcp` (in the harness's process). Inside: ``python bridge.py --socket PATH --port PORT -- ARGV``
listens on ``127.0.0.1:PORT``, runs ``ARGV`` and exits with its status. Standard library only, and runnable by its path
(the isolated user runs it with the system's interpreter).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
from typing import Callable

__all__ = ["UnixToTcp", "main"]


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def _join(client: socket.socket, connect: Callable[[], socket.socket]) -> None:
    try:
        upstream = connect()
    except OSError:
        client.close()
        return
    back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
    back.start()
    _pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()


class _Forwarder:
    def __init__(self, listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
        self.listener, self.connect = listener, connect
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=_join, args=(client, self.connect), daemon=True).start()

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()


class UnixToTcp(_Forwarder):
    """Accept on the Unix socket ``path`` (made here, mode 0666 so the isolated user can connect) and join each
    connection to ``host:port``."""

    def __init__(self, path: str, host: str, port: int) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        os.chmod(path, 0o666)
        listener.listen(64)
        self.path = path
        super().__init__(listener, lambda: socket.create_connection((host, port)))


class TcpToUnix(_Forwarder):
    """Accept on ``127.0.0.1:port`` and join each connection to the Unix socket ``path``."""

    def __init__(self, port: int, path: str) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)

        def connect() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            return s

        super().__init__(listener, connect)


def main(argv: list[str] | None = None) -> int:
    """Inside the namespace: listen on ``127.0.0.1:PORT`` for the endpoint, run the command, return its status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        raise SystemExit("usage: bridge.py --socket PATH --port PORT -- COMMAND...")
    cut = args.index("--")
    parser = argparse.ArgumentParser(prog="bridge.py")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--port", type=int, required=True)
    options = parser.parse_args(args[:cut])
    TcpToUnix(options.port, options.socket)
    return subprocess.call(args[cut + 1 :])


if __name__ == "__main__":
    sys.exit(main())
