import sys

from pagoda.cli.main import main

sys.exit(main())
