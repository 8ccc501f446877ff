"""``python -m kvprefetch``: the command line, as the ``kvprefetch`` script."""

import sys

from kvprefetch.controlplane.cli import main

sys.exit(main())
