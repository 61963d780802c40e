"""A network namespace joined to the host by a veth pair: one member runs inside it and
reaches the scenario's server over that link only, so the link can be cut (both ends
down: nothing passes, TCP connections stay open and retransmit) or degraded (a token
bucket on both ends: a slow link that queues and drops) while the other members carry on.

Needs root (`ip netns`, iproute2). This kernel has no `netem` qdisc, so loss and latency
come from `tbf`: a low rate and a short queue add queueing delay and drop what
overflows it.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _tc(*args: str, netns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, "tc", *args], check=True, capture_output=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"ip netns does not work here: {e}"
    return None


@dataclass
class Netns:
    name: str
    host_if: str
    inner_if: str
    host_ip: str
    inner_ip: str
    subnet: str

    @classmethod
    def create(cls, tag: int) -> Netns:
        """A namespace and a /30 link in 10.213.0.0/16, named after `tag` (a pid)."""
        third, fourth = (tag // 64) % 256, (tag % 64) * 4
        net = f"10.213.{third}.{fourth}"
        host_ip, inner_ip = f"10.213.{third}.{fourth + 1}", f"10.213.{third}.{fourth + 2}"
        ns = cls(f"pgjobd-chaos-{tag}", f"pjc{tag}h", f"pjc{tag}n", host_ip, inner_ip,
                 f"{net}/30")  # fmt: skip
        _ip("netns", "add", ns.name)
        try:
            _ip("link", "add", ns.host_if, "type", "veth", "peer", "name", ns.inner_if)
            _ip("link", "set", ns.inner_if, "netns", ns.name)
            _ip("addr", "add", f"{host_ip}/30", "dev", ns.host_if)
            _ip("link", "set", ns.host_if, "up")
            _ip("-n", ns.name, "addr", "add", f"{inner_ip}/30", "dev", ns.inner_if)
            _ip("-n", ns.name, "link", "set", ns.inner_if, "up")
            _ip("-n", ns.name, "link", "set", "lo", "up")
        except BaseException:
            ns.destroy()
            raise
        return ns

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def cut(self) -> None:
        _ip("link", "set", self.host_if, "down")
        _ip("-n", self.name, "link", "set", self.inner_if, "down")

    def heal(self) -> None:
        _ip("link", "set", self.host_if, "up")
        _ip("-n", self.name, "link", "set", self.inner_if, "up")

    def degrade(self, rate: str = "128kbit", latency: str = "50ms") -> None:
        for netns, dev in ((None, self.host_if), (self.name, self.inner_if)):
            _tc("qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "2kb",
                "latency", latency, netns=netns)  # fmt: skip

    def restore(self) -> None:
        for netns, dev in ((None, self.host_if), (self.name, self.inner_if)):
            _tc("qdisc", "del", "dev", dev, "root", netns=netns)

    def destroy(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)
