import sys

from traindx.cli import main

sys.exit(main())
