"""`python -m supervisor.ctl`: sessionctl's full command line (ctl/cli.py)."""

import sys

from supervisor.ctl.cli import main

sys.exit(main())
