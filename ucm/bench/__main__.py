"""`python -m ucm.bench [...]`: the same as `ucm bench [...]`."""

from __future__ import annotations

import sys

from ucm.bench.command import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
