import sys

from distrun.server._main import main

sys.exit(main())
