"""`python -m ocria_rt ...`: the same as the `ocria-rt` command."""

import sys

from .cli import main

sys.exit(main())
