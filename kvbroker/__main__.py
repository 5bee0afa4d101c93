import sys

from kvbroker.cli import main

sys.exit(main())
