"""How every attnlab subcommand ends: worded one-line errors for people, exit codes, no traceback
unless ``ATTNLAB_DEBUG`` is set. Shared by ``attnlab analyze`` and ``attnlab corpus``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "error", "run_worded"]


def error(command: str, message) -> None:
    """``attnlab <command>: error: <message on one line>`` on stderr."""
    print(f"attnlab {command}: error: {' '.join(str(message).split())}", file=sys.stderr)


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
