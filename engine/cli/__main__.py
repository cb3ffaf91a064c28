"""`python -m engine.cli`: the `policylens` command (torchrun starts ranks this way)."""

import sys

from engine.cli import main

sys.exit(main())
