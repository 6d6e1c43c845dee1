"""`python -m epd.cli ...`: the `epd` command."""
import sys

from epd.cli import main

sys.exit(main())
