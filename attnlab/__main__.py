"""``python -m attnlab ...``: the ``attnlab`` command (attnlab.cli), for environments without the
console script on PATH."""

import sys

from attnlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
