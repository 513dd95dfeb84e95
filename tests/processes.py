"""Processes the test suite starts: stopped so they cannot outlive a test, and found if they did.

Every process started from the suite inherits ``SESSION_VARIABLE`` (tests/conftest.py sets it once per
session), so a leftover is found by its environment even after its parent died and it was reparented.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from pathlib import Path

from tasks.processes import stop_group

SESSION_VARIABLE = "PYTEST_MLSTM_SESSION"
__all__ = ["SESSION_VARIABLE", "listening_tcp", "started_by_session", "stop_group"]


def started_by_session(token: str) -> list[str]:
    """``PID command line`` of every live process (not this one) whose environment holds the token."""
    marker = f"{SESSION_VARIABLE}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()  # a zombie's is empty: it is already gone
            if marker not in environ.split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited meanwhile, or another user's
        found.append(f"{entry.name} {command.strip()}")
    return found


def listening_tcp(root: int) -> list[tuple[int, str]]:
    """``(pid, address:port)`` of every TCP socket in the LISTEN state held by ``root`` or a descendant,
    from ``/proc/net/tcp{,6}`` joined with the processes' ``/proc/PID/fd`` links (Linux)."""
    listening = {}  # socket inode → address:port
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)  # 32-bit words in host (little-endian) order
            address = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
            listening[fields[9]] = f"{address}:{int(hex_port, 16)}"
    found = []
    for pid in _descendants(root):
        with contextlib.suppress(OSError):  # exited meanwhile
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in listening:
                        found.append((pid, listening[target[8:-1]]))
    return found


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found
