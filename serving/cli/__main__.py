"""`python -m serving.cli ...` runs the `raypd` command."""

import sys

from serving.cli.main import main

sys.exit(main())
