"""``python -m pagoda``: the same as the ``pagoda`` command."""

import sys

from pagoda.cli.main import main

sys.exit(main())
