"""`python -m loadtest` (console script `kvserve-loadtest`)."""

import sys

from loadtest.client import main

sys.exit(main())
