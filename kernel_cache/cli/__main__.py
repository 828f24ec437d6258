import sys

from traindx.kernel_cache.cli.main import main

sys.exit(main())
