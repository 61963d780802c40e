"""A small tmpfs that stands for one of the server's volumes (its pg_wal, or its data
directory): the scenario fills it with a filler file while the server runs, and empties
it again.

Needs root (`mount -t tmpfs`). Unmounted lazily if something still holds a file in it,
so that a run that failed half-way leaves no mount behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

FILLER = "chaos-filler"
CHUNK = 1 << 20


def available() -> str | None:
    """None when a tmpfs can be mounted here, else why not."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount(8) here"
    return None


def relocate(directory: Path, target: Path, uid: int, gid: int) -> None:
    """Move `directory`'s contents to `target` and leave a symlink in its place (as
    `initdb --waldir` does for pg_wal)."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in directory.iterdir():
        shutil.move(str(entry), target / entry.name)
    directory.rmdir()
    directory.symlink_to(target)
    for root, dirs, files in os.walk(target):
        for name in [".", *dirs, *files]:
            os.chown(os.path.join(root, name), uid, gid)


@dataclass
class Volume:
    path: Path
    size_mb: int
    mounted: bool = False

    @classmethod
    def mount(cls, path: Path, size_mb: int) -> Volume:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
            check=True, capture_output=True,
        )  # fmt: skip
        return cls(path, size_mb, mounted=True)

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave_bytes: int) -> int:
        """Write the filler until at most `leave_bytes` are free; the bytes written."""
        written = 0
        block = b"\0" * CHUNK
        with (self.path / FILLER).open("ab", buffering=0) as f:
            while (free := self.free_bytes()) > leave_bytes:
                try:
                    written += f.write(block[: min(CHUNK, free - leave_bytes)]) or 0
                except OSError:  # ENOSPC: the server's own writes got there first
                    break
        return written

    def empty(self) -> None:
        (self.path / FILLER).unlink(missing_ok=True)

    def unmount(self) -> None:
        if not self.mounted:
            return
        try:
            subprocess.run(["umount", str(self.path)], check=True, capture_output=True)
        except subprocess.CalledProcessError:
            with contextlib.suppress(subprocess.CalledProcessError):
                subprocess.run(["umount", "-l", str(self.path)], check=True, capture_output=True)
        self.mounted = False
