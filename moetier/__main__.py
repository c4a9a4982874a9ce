import sys

from moetier.cli.main import main

sys.exit(main())
