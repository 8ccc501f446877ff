import sys

from kvprefetch.controlplane.cli import main

sys.exit(main())
