"""``python -m latchkey`` is the ``latchkey`` command."""

import sys

from latchkey.cli import main

sys.exit(main())
