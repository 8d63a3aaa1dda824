"""``python -m steadytrain``: the same command as ``steadytrain`` (``torchrun -m steadytrain`` needs it)."""

import sys

from steadytrain.cli import main

sys.exit(main())
