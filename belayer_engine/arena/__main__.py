"""``python -m belayer_engine.arena``: run an arena server (see ``server``)."""

import sys

from belayer_engine.arena.server import main

sys.exit(main())
