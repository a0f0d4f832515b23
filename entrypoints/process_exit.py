"""Ending a server process once its orderly shutdown is done, without the interpreter's teardown.

After the last request is answered and the engine stopped, a process that imported torch still
spends seconds in CPython's finalisation (module teardown, garbage collections over torch's
objects): about 1 s in the engine process and 1.3 s in the HTTP process on one core, measured
with strace, so every `SIGTERM` took ~2.5 s. Nothing of that work is needed: the sockets are
closed, the logs flushed and the atexit handlers (multiprocessing's, temporary folders) run here.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn


def exit_now(code: int) -> NoReturn:
    """Run the atexit handlers, flush the logs and standard streams, and end the process with
    ``code``."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream has nothing left to flush
    os._exit(code)


def run_then_exit(target: Callable[..., Any] | str, *args: Any) -> NoReturn:
    """A process entry: ``target(*args)``, then ``exit_now`` with the code Python would have
    given: the target's if it returned an int, else 0; a SystemExit's code (a server stopped
    by SIGTERM leaves through one); 1 after printing an uncaught exception.

    ``target`` may be named ("package.module:function") and is then imported here, in the new
    process: the HTTP process starts the engine without importing the engine's modules (torch
    and the model code, seconds of a start on one core)."""
    try:
        if isinstance(target, str):
            module, _, name = target.partition(":")
            target = getattr(importlib.import_module(module), name)
        result = target(*args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
        traceback.print_exc()
        code = 1
    else:
        code = result if isinstance(result, int) else 0
    exit_now(code)
