import sys

from fedray.app.cli import main

sys.exit(main())
