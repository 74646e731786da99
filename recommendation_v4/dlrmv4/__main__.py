import sys

from dlrmv4.cli import main

sys.exit(main())
