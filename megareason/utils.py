"""Small helpers shared across modules."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (for torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
