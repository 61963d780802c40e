import sys

from pgjobd.cli import main

sys.exit(main())
