"""``python -m bench.loadtest ...``: the same as ``pdserve bench serve ...``."""

import sys

from bench.loadtest.cli import main

sys.exit(main())
