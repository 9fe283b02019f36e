"""`python -m ucm.proxy ...`: the same as `ucm proxy ...`."""

import sys

from ucm.proxy.front import main

sys.exit(main(sys.argv[1:]))
