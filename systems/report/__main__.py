import sys

from systems.report import main

sys.exit(main())
