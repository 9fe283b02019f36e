"""`python -m ucm.proxy ...`: the same as `ucm proxy ...`."""

from __future__ import annotations

import sys

from ucm.proxy.front import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
