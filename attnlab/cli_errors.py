"""How every attnlab subcommand ends: worded one-line errors for people, exit codes, no traceback
unless ``ATTNLAB_DEBUG`` is set. Shared by ``attnlab analyze`` and ``attnlab corpus``."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "error", "run_worded", "worded_warnings"]

_OWN = ("attnlab: ", "attnlab.hf: ")  # how attnlab's own warnings begin


def error(command: str, message) -> None:
    """``attnlab <command>: error: <message on one line>`` on stderr."""
    print(f"attnlab {command}: error: {' '.join(str(message).split())}", file=sys.stderr)


@contextlib.contextmanager
def worded_warnings(command: str) -> Iterator[None]:
    """attnlab's own warnings (a variant's weights materialized, the CPU kernels unavailable, ...) as
    ``attnlab <command>: note: <message>`` lines on stderr, like the commands' other notes, instead of
    Python's ``file:line: UserWarning:`` and the source line. Other packages' warnings show as Python
    shows them."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = " ".join(str(message).split())
        own = next((p for p in _OWN if text.startswith(p)), None)
        if own is None:
            return shown(message, category, filename, lineno, file, line)
        from tqdm import tqdm  # above a progress bar, not inside its line

        tqdm.write(f"attnlab {command}: note: {text.removeprefix(own)}", file=sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def run_worded(command: str, run: Callable[[], int], interrupted: str) -> int:
    """``run()``'s exit code; a ValueError or OSError (bad input, worded for people) -> 2, Ctrl-C ->
    130 with ``interrupted``, anything else (a bug) -> 1 with its class and message."""
    try:
        return run()
    except ValueError as e:  # InputError, ModelLoadError, bad settings: all worded for people
        error(command, e)
        return EXIT_BAD_INPUT
    except OSError as e:
        error(command, f"{e.strerror or e}: {e.filename}" if getattr(e, "filename", None) else e)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        error(command, interrupted)
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug: still no traceback unless asked for
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        error(command, f"internal error ({e.__class__.__name__}: {e}); set ATTNLAB_DEBUG=1 for the traceback")
        return EXIT_INTERNAL
