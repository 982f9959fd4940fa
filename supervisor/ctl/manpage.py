"""sessionctl(1), generated from the argparse definitions:

    python -m supervisor.ctl.manpage > sessionctl.1      (`make man` writes man/sessionctl.1)
"""

from __future__ import annotations

import sys

from supervisor.ctl.completion import man_page
from supervisor.ctl.cli import _parser
from supervisor.ctl.render import EXIT_OK

__all__ = ["main"]


def main() -> int:
    sys.stdout.write(man_page(_parser()))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
