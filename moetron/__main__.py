"""`python -m moetron ...` (and `torchrun -m moetron ...`) run the command line."""

import sys

from moetron.cli import main

sys.exit(main())
