"""python -m gpulab.devcluster up|down|status"""

import sys

from .cli import main

sys.exit(main())
