"""Imported by the launcher's forkserver only (the last of FORKSERVER_PRELOAD): the server, once its last client has
ended, exits without tearing down the torch and transformers it imported (seconds of CPU on a loaded machine, with
the run's output held open, and a `kill -9` of the launcher leaving it behind meanwhile). The workers it forks
inherit the handler; it does nothing in them."""

import atexit
import os

_SERVER = os.getpid()


def _exit_now() -> None:
    if os.getpid() == _SERVER:
        os._exit(0)


atexit.register(_exit_now)
