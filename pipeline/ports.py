"""Ports on 127.0.0.1 for the servers quantpipe starts.

port = free_port()            # the kernel's choice; vLLM binds it a moment later
assert port_freed(port, 30)   # after the server stopped
"""

from __future__ import annotations

import socket
import time

HOST = "127.0.0.1"  # quantpipe's servers listen on this machine only


def free_port(host: str = HOST) -> int:
    """A port nobody listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = HOST) -> bool:
    """Whether a server could not listen on the port now. Binds with SO_REUSEADDR, as uvicorn does, rather
    than connecting: a connect to a free port in the ephemeral range can, rarely, connect to itself."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def port_freed(port: int, timeout_s: float = 30, host: str = HOST) -> bool:
    """Wait for the port to be free. A process SIGKILLed a moment ago may still hold its sockets: Linux
    shows a killed multi-threaded process as a zombie before its last thread has closed its files."""
    deadline = time.monotonic() + timeout_s
    while port_in_use(port, host):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
