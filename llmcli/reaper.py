"""`python -m llmcli.reaper PARENT_PID [--name NAME] COMMAND [ARG…]`: run COMMAND so that nothing it starts outlives
llmcli (NAME: how llmcli finds this reaper again among its children, to end a hung COMMAND's tree at once).

An MCP server is a stranger's program, and it may start programs of its own — some in a new session, out of reach of
the process-group kill its client sends. So llmcli starts it through this small process, which
- makes itself the *subreaper* of everything below it (Linux's PR_SET_CHILD_SUBREAPER): a descendant whose parent
  exits is re-parented here, not to init, so every descendant stays findable as one of this process's tree;
- asks for SIGTERM when its parent dies (PR_SET_PDEATHSIG), so that even `kill -9` of llmcli reaches it;
- runs COMMAND as its child, on the same standard streams, and when COMMAND exits, or this process is told to stop
  (SIGTERM, SIGINT, SIGHUP, its parent's death), ends the whole tree below it: SIGTERM to each descendant, then
  SIGKILL to what is left after GRACE_S, every one reaped; it exits with COMMAND's status.

Elsewhere than Linux it replaces itself with COMMAND (the MCP SDK's process-group kill is all there is).
Imports nothing of llmcli: it starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 1.0


def command(parent: int, argv: list[str], name: str | None = None) -> list[str]:
    """The command line that runs `argv` under a reaper for the process `parent` (this Python, this module); `name`:
    what `named` finds it by."""
    return [sys.executable, "-m", "llmcli.reaper", str(parent), *(["--name", name] if name else []), *argv]


def named(name: str) -> list[int]:
    """The reapers this process started by `command(os.getpid(), …, name)` that still run."""
    marker = ["-m", "llmcli.reaper", str(os.getpid()), "--name", name]
    found = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = [part.decode("utf-8", "surrogateescape") for part in handle.read().split(b"\0")]
        except OSError:
            continue
        if argv[1:6] == marker:
            found.append(pid)
    return found


def end_named(name: str) -> None:
    """Tell the reapers called `name` to end their trees now (SIGTERM: each ends its tree, then exits)."""
    for pid in named(name):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def descendants(root: int) -> list[int]:
    """Every live process below `root`, from /proc (parents before their children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether process `pid` still runs: one that has exited but that its parent (often init, which may reap only
    now and then) has not reaped yet, a zombie, holds nothing (no memory, no socket, no core) and is not; another
    user's process is."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[-1].split()[:1]
    except OSError:  # gone meanwhile; or no /proc (not Linux), and os.kill's answer stands
        return not os.path.isdir("/proc/self")
    return state != [b"Z"]


def end_tree(root: int, grace: float = GRACE_S) -> None:
    """SIGTERM every process below `root`, SIGKILL what is left after `grace`; reap them all (root is a subreaper)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        for pid in descendants(root):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while True:
            _reap()
            if not descendants(root) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if not descendants(root):
            return


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class _Stop(Exception):
    """A signal to stop: raised from its handler, so that a waiting waitpid() returns."""


def main(argv: list[str]) -> int:
    if argv[1:2] == ["--name"]:
        argv = argv[:1] + argv[3:]  # (the name is for llmcli to read in /proc)
    if len(argv) < 2 or not argv[0].isdigit():
        sys.stderr.write("usage: python -m llmcli.reaper PARENT_PID [--name NAME] COMMAND [ARG...]\n")
        return 2
    parent, program = int(argv[0]), argv[1:]
    if not sys.platform.startswith("linux"):
        os.execvp(program[0], program)
    stopping: list[int] = []
    waiting = [True]  # _Stop breaks the wait, once: a signal after that (a second one) must not skip end_tree

    def stop(signum: int, frame: object) -> None:
        stopping.append(signum)
        if waiting[0]:
            waiting[0] = False
            raise _Stop

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for signum in signals:
        signal.signal(signum, stop)
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # held until the child runs and is waited for
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the death signal was asked for
        return 143
    try:
        child = subprocess.Popen(program, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, signals))
    except OSError as exc:
        sys.stderr.write(f"cannot start {program[0]}: {exc.strerror or exc}\n")
        return 127
    status = None
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        while status is None:
            try:
                pid, code = os.waitpid(-1, 0)  # any descendant re-parented here is reaped as it goes
            except ChildProcessError:
                break
            if pid == child.pid:
                status = os.waitstatus_to_exitcode(code)
        waiting[0] = False
    except _Stop:
        pass
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # ending the tree is not to be cut short
    end_tree(os.getpid())
    if status is None:
        return 128 + stopping[0] if stopping else 0
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
