import sys

from maxperf.cli import main

sys.exit(main())
