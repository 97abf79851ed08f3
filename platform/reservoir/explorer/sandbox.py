"""Running a program a model wrote: a process of its own, with limits, and nothing to reach.

`run_python(code, stdin, limits)` runs `code` with the interpreter in isolated mode (`-I`: no
environment variables read, no user site) in a new session, with:

- a temporary working folder (removed after) and an environment of its own (PATH, HOME, LANG:
  none of the explorer's variables);
- limits (setrlimit): CPU seconds, address space, file size, open files, processes, no core;
- no network: a network namespace of its own (only a loopback that is down) where the kernel
  allows one (root, or unprivileged user namespaces), and in any case a prelude that refuses
  to create sockets before the program runs;
- as root: a mount namespace with fresh tmpfs over /tmp, /var/tmp and /dev/shm (nothing it
  writes there outlives it), and a user id of its own for the call (from SANDBOX_UIDS), so it
  can write only its folder, cannot read other processes' environments, its process limit
  counts only its own processes, and every process it leaves is killed by uid at the end;
- a wall-clock timeout, after which its whole session (and, as root, its uid) is killed.

The outcome says how it ended: exit code, output (truncated), timed out, killed.
"""

from __future__ import annotations

import ctypes
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
SANDBOX_UIDS = (1_500_000, 1_600_000)  # ids no account uses: one per call, run as root
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
OUTPUT_LIMIT = 64 * 1024  # characters of stdout / stderr kept
PRELUDE = """\
import socket as _socket, _socket as _raw
def _refused(*args, **kwargs):
    raise PermissionError("the sandbox has no network")
for _module in (_socket, _raw):
    for _name in ("socket", "create_connection", "socketpair", "fromfd", "create_server"):
        if hasattr(_module, _name):
            setattr(_module, _name, _refused)
del _socket, _raw, _module, _name, _refused
"""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    memory_mb: int = 512
    file_mb: int = 8
    processes: int = 16
    open_files: int = 64
    wall_s: float = 10.0


@dataclass(frozen=True)
class Outcome:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def interpreter() -> str:
    """The Python the sandbox runs: the system's (a user id of the sandbox's own can run it;
    a virtual environment under a private home may not be), else this one."""
    return next((path for path in SYSTEM_PYTHONS if os.access(path, os.X_OK)), sys.executable)


def run_python(code: str, stdin: str = "", limits: Limits = Limits(),
               python: str | None = None) -> Outcome:
    """Run `code` in the sandbox, `stdin` on its standard input (with `python`, default
    `interpreter()`); the outcome, never an exception for anything the code does."""
    folder = Path(tempfile.mkdtemp(prefix="reservoir-sandbox-"))
    uid = random.randrange(*SANDBOX_UIDS) if os.geteuid() == 0 else None
    try:
        (folder / "main.py").write_text(PRELUDE + code, encoding="utf-8")
        if uid is not None:
            os.chown(folder, uid, uid)
            os.chown(folder / "main.py", uid, uid)
        process = subprocess.Popen(
            [python or interpreter(), "-I", "-S", "main.py"], cwd=folder, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
            env={"PATH": "/usr/bin:/bin", "HOME": str(folder), "LANG": "C.UTF-8"},
            preexec_fn=lambda: _confine(limits, uid, PRELUDE + code), close_fds=True)
        timed_out = False
        try:
            out, err = process.communicate(stdin, timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(process.pid, uid)
            out, err = process.communicate()
        _kill(process.pid, uid)  # anything it left behind
        return Outcome(process.returncode, out[:OUTPUT_LIMIT], err[:OUTPUT_LIMIT], timed_out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _confine(limits: Limits, uid: int | None, program: str) -> None:
    """In the child, before the interpreter starts: a session, namespaces, limits, a uid."""
    os.setsid()
    if _namespaces(root=uid is not None):  # its folder moves into the private /tmp
        os.makedirs("/tmp/work")
        Path("/tmp/work/main.py").write_text(program, encoding="utf-8")
        for path in ("/tmp/work", "/tmp/work/main.py"):
            os.chown(path, uid, uid)
        os.chdir("/tmp/work")
    for limit, value in ((resource.RLIMIT_CPU, limits.cpu_s),
                         (resource.RLIMIT_AS, limits.memory_mb * 2**20),
                         (resource.RLIMIT_FSIZE, limits.file_mb * 2**20),
                         (resource.RLIMIT_NOFILE, limits.open_files),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    if uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _namespaces(root: bool) -> bool:
    """A network namespace (and, as root, a mount namespace with private tmpfs over the
    folders anyone may write) where the kernel allows; whether the private /tmp is there. The
    prelude refuses sockets either way."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not root:
        libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)
        return False
    if libc.unshare(CLONE_NEWNET | CLONE_NEWNS) != 0 or \
            libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    for path in PRIVATE_TMP:
        if os.path.isdir(path) and libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0,
                                              b"size=16m,mode=1777") != 0:
            return False
    return True


def _kill(pid: int, uid: int | None) -> None:
    """Kill the call's session and, as root, every process of its uid."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is None:
        return
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
