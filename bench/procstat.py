"""CPU time of processes from /proc: what the benches measure CPU with (robust on a
loaded machine, unlike wall time). Imports nothing of pgjobd, so a bench can use it
while running another tree's code."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, user+system ticks) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rfind(")") + 2 :].split()
    return int(rest[1]), int(rest[11]) + int(rest[12])


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) and stat[0] == pid:
            found.append(int(entry))
    return found


def postgres_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{entry}/comm").read_text().strip() == "postgres":
                    pids.append(int(entry))
    return pids


def machine_ticks() -> tuple[int, int]:
    """(all, idle+iowait) ticks of the machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]


@dataclass
class CpuSnapshot:
    at: float
    by_pid: dict[int, int]
    machine: tuple[int, int]


def cpu_snapshot(pids: Iterable[int]) -> CpuSnapshot:
    by_pid = {pid: stat[1] for pid in pids if (stat := proc_stat(pid)) is not None}
    return CpuSnapshot(time.time(), by_pid, machine_ticks())


def cpu_split(
    before: CpuSnapshot, after: CpuSnapshot, roles: dict[str, list[int]]
) -> dict[str, float]:
    """Cores used by each role between two snapshots (a process gone by the end is not
    counted; one new since the start counts from its start); 'idle' is the machine's."""
    wall = after.at - before.at
    split = {}
    for role, pids in roles.items():
        ticks = sum(after.by_pid[p] - before.by_pid.get(p, 0) for p in pids if p in after.by_pid)
        split[role] = ticks * TICK_S / wall
    total, idle = (a - b for a, b in zip(after.machine, before.machine, strict=True))
    cores = os.cpu_count() or 1
    split["idle"] = cores * idle / total if total else 0.0
    split["rest"] = cores - sum(split.values())  # other processes, the kernel
    return split
