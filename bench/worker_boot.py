"""Boot cost of one worker process: time from spawn to its Ready frame, its resident memory.

Spawns the worker the way the supervisor does (stdin/stdout pipes, the example handlers/
directory), waits for Ready, reads VmRSS and VmHWM from /proc/<pid>/status, then sends
Stop and reaps it. Repeats, interleaving the commands compared, and prints the median
and min of each. Then, once per command, `-X importtime` for the number of modules the
child imported and their cumulative import time.

    .venv/bin/python bench/worker_boot.py [--reps 15] [--handler-dir handlers]
        [--command "-m pgjobd.worker"] [--command "PYTHONPATH=/tmp/old -m pgjobd worker"]

A command is the interpreter's arguments, after optional NAME=value environment settings
(PYTHONPATH=DIR runs the pgjobd package found in DIR, e.g. an older commit's checkout:
`git archive <commit> pgjobd | tar -x -C DIR`).

Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from pgjobd.protocol import Decoder, Ready, Stop, ToParent, encode_frame

HEADER = struct.Struct(">I")


def _read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError(f"worker output ended after {len(data)} of {n} bytes")
        data += chunk
    return data


def _status(pid: int) -> dict[str, int]:
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])  # kB
    return fields


def _split(command: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(command)
    env = dict(os.environ)
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def boot_once(command: str, handler_dir: str) -> tuple[float, dict[str, int]]:
    env, prefix = _split(command)
    argv = [sys.executable, *prefix, "--queue", "default", "--handler-dir", handler_dir,
            "--slots", "1"]  # fmt: skip
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert process.stdin is not None and process.stdout is not None
    fd = process.stdout.fileno()
    (length,) = HEADER.unpack(_read_exactly(fd, HEADER.size))
    message = Decoder[ToParent](ToParent).decode(_read_exactly(fd, length))
    elapsed = time.perf_counter() - started
    if not isinstance(message, Ready):
        raise RuntimeError(f"worker sent {message!r}, not Ready")
    memory = _status(process.pid)
    process.stdin.write(encode_frame(Stop()))
    process.stdin.close()
    if process.wait(timeout=30) != 0:
        raise RuntimeError(f"worker exited {process.returncode}")
    return elapsed, memory


def import_profile(command: str, handler_dir: str) -> tuple[int, float]:
    """Modules imported by a worker that boots and stops, and their total self time."""
    env, prefix = _split(command)
    argv = [sys.executable, "-X", "importtime", *prefix, "--queue", "default",
            "--handler-dir", handler_dir, "--slots", "1"]  # fmt: skip
    process = subprocess.run(
        argv, input=encode_frame(Stop()), capture_output=True, timeout=60, check=True, env=env
    )
    modules = 0
    self_us = 0
    for line in process.stderr.decode().splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            modules += 1
            self_us += int(line.split(":", 1)[1].split("|")[0])
    return modules, self_us / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--handler-dir", default=str(Path("handlers").resolve()))
    parser.add_argument("--command", action="append", dest="commands")
    args = parser.parse_args()
    commands = args.commands or ["-m pgjobd.worker"]
    results: dict[str, list[tuple[float, dict[str, int]]]] = {c: [] for c in commands}
    boot_once(commands[0], args.handler_dir)  # warm the page cache
    for _ in range(args.reps):
        for command in commands:
            results[command].append(boot_once(command, args.handler_dir))
    for command in commands:
        runs = results[command]
        times = [t for t, _ in runs]
        rss = [m["VmRSS"] for _, m in runs]
        hwm = [m["VmHWM"] for _, m in runs]
        modules, import_s = import_profile(command, args.handler_dir)
        print(
            f"python {command}: to Ready median {statistics.median(times) * 1000:.0f} ms "
            f"(min {min(times) * 1000:.0f}); VmRSS at Ready median "
            f"{statistics.median(rss) / 1024:.1f} MiB (VmHWM {statistics.median(hwm) / 1024:.1f}); "
            f"{modules} modules imported, {import_s * 1000:.0f} ms import self time"
        )


if __name__ == "__main__":
    main()
