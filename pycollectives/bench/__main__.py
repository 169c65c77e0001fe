"""``python -m pycollectives.bench``: the same as the ``pycollectives-bench`` command."""

import sys

from pycollectives.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
