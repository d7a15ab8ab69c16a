"""``python -m stagetree.dashboard SOURCE [--host H] [--port P]``: see :mod:`stagetree.dashboard.cli`."""

import sys

from stagetree.dashboard.cli import main

sys.exit(main())
