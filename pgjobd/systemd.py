"""systemd's notify protocol: READY=1, RELOADING=1, STOPPING=1, WATCHDOG=1 datagrams
to $NOTIFY_SOCKET (sd_notify(3)), written here because it is a dozen lines."""

from __future__ import annotations

import logging
import os
import socket

import anyio

log = logging.getLogger(__name__)


def notify(*states: str) -> bool:
    """Send `states` ("READY=1", ...) if systemd asked for them; True if sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(states).encode())
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", address, e)
        return False
    return True


def watchdog_interval_s() -> float | None:
    """Half of $WATCHDOG_USEC (when it is meant for this process), else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2_000_000
    except ValueError:
        return None


async def keep_watchdog_fed() -> None:
    """WATCHDOG=1 every half period, from the main event loop: a stuck loop starves
    systemd's watchdog and gets the daemon restarted."""
    interval_s = watchdog_interval_s()
    if interval_s is None:
        return
    while True:
        notify("WATCHDOG=1")
        await anyio.sleep(interval_s)
