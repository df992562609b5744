"""One spawned process per GPU, driven over a multiprocessing pipe: the GPU benchmarks' child processes.

    driver                                       child process (child_main)
    Child(name, role, *args)   -- spawn -->      role(*args): builds its cache, sender, receiver ...
    expect(Ready)              <-- Ready --
    send(cmd)                  -- cmd -->        role.serve(conn, cmd): its replies on conn
    expect(kind)               <-- reply --
    stop_all(children, grace)  -- None -->       role.close(), exits
                               <-- Failed --     any exception: its name and traceback, then it exits

Every wait of the driver is bounded: a child that fails, exits without a reply or stays silent ends the wait
with an error that names it (with its exit code, or the traceback it sent), and stop_all ends every child,
whatever state it is in. Children are spawned (CUDA cannot be forked) and daemonic: they end with the driver.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
CTX = mp.get_context("spawn")


@dataclass(frozen=True)
class Ready:
    """A child built its role: it takes commands."""


@dataclass(frozen=True)
class Failed:
    error: str  # the child's name and traceback, or the driver's note that it exited without a reply
    at: float  # time.monotonic(): one failure often fails another child, so the earliest is the cause


class Role(Protocol):
    """What a child process runs, built in the child from the Child's args."""

    def serve(self, conn: Connection, cmd: Any) -> None:
        """Carry out one command of the driver, sending its replies (of the types the script agrees) on conn."""

    def close(self) -> None:
        """Release what the role holds; called once as the child ends, also after a failure."""


def child_main(conn: Connection, name: str, role: Callable[..., Role], *args: Any) -> None:
    """A child's life: build the role, say Ready, serve the driver's commands until None. An exception goes to
    the driver first (as Failed), then ends the process."""
    served = None
    try:
        served = role(*args)
        conn.send(Ready())
        while (cmd := conn.recv()) is not None:
            served.serve(conn, cmd)
    except Exception:
        with contextlib.suppress(OSError):  # the driver is gone: nobody to tell
            conn.send(Failed(f"{name}: {traceback.format_exc()}", time.monotonic()))
        raise
    finally:
        if served is not None:
            served.close()


def recv_within(conn: Connection, timeout: float, what: str) -> Any:
    """A child's next message on a pipe (from the driver or a peer child), waiting at most `timeout`."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} within {timeout:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"the pipe closed while waiting for {what}: the other process exited") from None


class Child:
    """One spawned child process and the driver's end of its pipe; every wait on it is bounded."""

    def __init__(self, name: str, role: Callable[..., Role], *args: Any) -> None:
        self.name = name
        self.conn, theirs = CTX.Pipe()
        self.proc = CTX.Process(target=child_main, args=(theirs, name, role, *args), daemon=True)
        self.proc.start()
        theirs.close()  # the child holds the only other end: its exit shows here as EOF

    def send(self, cmd: object) -> None:
        try:
            self.conn.send(cmd)
        except OSError as exc:  # its end is closed: it exited
            raise RuntimeError(f"{self.name} is gone ({self.state()})") from exc

    def expect(self, kind: type[T], timeout: float) -> T:
        """Its next message, which must be a `kind`, within `timeout`; see expect_all."""
        return expect_all([self], kind, timeout)[0]

    def read(self) -> object:
        """Its next message; an exit without one (a crash: often the cause of what others report) as Failed."""
        try:
            return self.conn.recv()
        except EOFError:
            return Failed(f"{self.name} exited without a reply ({self.state()})", 0.0)

    def state(self) -> str:
        self.proc.join(1)  # one that closed its pipe is exiting: let its exit code arrive
        code = self.proc.exitcode
        return "still running" if code is None else f"exit code {code}"


def expect_all(children: Sequence[Child], kind: type[T], timeout: float) -> list[T]:
    """One `kind` message from each child, in order, within `timeout` in all. A failure or an exit of any of
    them raises RuntimeError at once, whatever the others are doing (they may be waiting on the one that
    failed); silence past `timeout` raises TimeoutError naming who was silent and whether it still runs."""
    deadline, got = time.monotonic() + timeout, dict[Child, Any]()
    while len(got) < len(children):
        waiting = [child for child in children if child not in got]
        left = deadline - time.monotonic()
        if left <= 0:
            silent = ", ".join(f"{child.name} ({child.state()})" for child in waiting)
            raise TimeoutError(f"no {kind.__name__} within {timeout:.0f} s from {silent}")
        ready = wait_any([child.conn for child in waiting], left)
        for child in [child for child in waiting if child.conn in ready]:
            got[child] = msg = child.read()
            if isinstance(msg, Failed):
                raise RuntimeError(failures(msg, [other for other in waiting if other is not child]))
            if not isinstance(msg, kind):
                raise RuntimeError(f"{child.name}: expected {kind.__name__}, got {type(msg).__name__}")
    return [got[child] for child in children]


def failures(first: Failed, others: Sequence[Child]) -> str:
    """`first` and what the other children already reported, the earliest (the cause) first."""
    found = [first] + [
        msg for child in others if child.conn.poll(0) and isinstance(msg := child.read(), Failed)
    ]
    return "\n".join(failed.error for failed in sorted(found, key=lambda failed: failed.at))


def ask(children: Sequence[Child], cmd: object, kind: type[T], timeout: float) -> list[T]:
    """`cmd` to every child, then one `kind` reply from each (expect_all)."""
    for child in children:
        child.send(cmd)
    return expect_all(children, kind, timeout)


def stop_all(children: Sequence[Child], grace_s: float) -> list[str]:
    """Ask each child to finish, kill whatever is left after `grace_s`; the names of those it killed. Raises
    nothing of its own: it runs in `finally` after any failure, on a part-started list, and twice."""
    for child in children:
        if child.proc.is_alive():
            with contextlib.suppress(
                OSError
            ):  # its end is gone (or closed by a first call): the join bounds it
                child.conn.send(None)
    deadline, killed = time.monotonic() + grace_s, []
    for child in children:
        child.proc.join(max(0.1, deadline - time.monotonic()))
        if child.proc.is_alive():
            child.proc.kill()
            child.proc.join(5)
            killed.append(child.name)
        child.conn.close()
    return killed
