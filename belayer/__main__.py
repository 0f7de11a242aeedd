import sys

from belayer.cli import main

sys.exit(main())
