"""``python -m attnlab.train ...`` (also the entry point for ``torchrun -m attnlab.train``)."""

import sys

from attnlab.train import main

sys.exit(main())
