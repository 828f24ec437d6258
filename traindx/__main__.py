import sys

from traindx.cli.main import main

sys.exit(main())
