"""``python -m parity``: the same as the ``parity`` command."""

import sys

from parity.cli import main

sys.exit(main())
