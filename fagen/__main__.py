"""python -m fagen: the command line (fagen.tools.cli)."""

import sys

from .tools.cli import main

sys.exit(main())
