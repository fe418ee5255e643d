"""CPython's private state that the forked workers and the fast exit reset or run (common/runtime/launcher.py,
common/run.py): multiprocessing's forkserver client and resource tracker, atexit's handlers, weakref's finalizers;
logging's last-resort handler (public, swapped here all the same)."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from contextlib import contextmanager
from multiprocessing import forkserver, resource_tracker

from common.compat import missing

PYTHONS = {(3, 11)}
"""The versions these were read on: elsewhere the launcher keeps fresh interpreters (no forkserver), as on a GPU."""


def forking_works() -> bool:
    """This interpreter is one the forked server was checked on."""
    return sys.version_info[:2] in PYTHONS and not check()


def check() -> list[str]:
    """The private names this module uses that this interpreter lacks (empty: all there)."""
    return (missing(forkserver._forkserver, ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid",
                                             "_stop"), "multiprocessing.forkserver._forkserver")
            + missing(resource_tracker._resource_tracker, ("_fd", "_pid"), "multiprocessing.resource_tracker")
            + missing(atexit, ("_clear", "_run_exitfuncs"), "atexit")
            + missing(weakref.finalize, ("_registry", "_registered_with_atexit"), "weakref.finalize"))


def adopt_forkserver(address: str, alive_fd: int, pid: int) -> None:
    """Make the server this process forked itself multiprocessing's forkserver, as `ForkServer.ensure_running`
    records one it spawned."""
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_fd, pid


def forkserver_pid() -> int | None:
    return forkserver._forkserver._forkserver_pid


def forget_forkserver() -> None:
    """multiprocessing's own clean-up: closes the alive pipe, reaps the server, removes its socket."""
    forkserver._forkserver._stop()


def forget_inherited_state() -> None:
    """In a worker forked from the server: its own resource tracker on first use (the inherited one would outlive a
    killed worker and warn about what the worker's guard already removed), and none of the exit handlers and
    finalizers registered before the fork (the launcher's: run at the worker's exit they would delete what the
    launcher and the other workers still use; the worker's first finalizer registers weakref's own again)."""
    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        os.close(tracker._fd)
        tracker._fd = tracker._pid = None
    atexit._clear()
    for finalizer in list(weakref.finalize._registry):
        finalizer.detach()
    weakref.finalize._registered_with_atexit = False


def run_exit_handlers() -> None:
    """What the interpreter runs at exit (atexit's handlers), now: before os._exit, which skips the teardown."""
    atexit._run_exitfuncs()


@contextmanager
def no_last_resort(drop: bool = True):
    """Inside: log records no handler takes are dropped instead of printed to stderr (`drop`)."""
    saved = logging.lastResort
    logging.lastResort = None if drop else saved
    try:
        yield
    finally:
        logging.lastResort = saved
