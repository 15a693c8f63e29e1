"""``python -m service.cli``: the ``fanout`` command."""

import sys

from service.cli.main import main

sys.exit(main())
