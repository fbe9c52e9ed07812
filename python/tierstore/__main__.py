"""``python -m tierstore`` runs the command-line tool."""

import sys

from tierstore.cli import main

sys.exit(main())
