"""python -m gpulab.spawner.devcluster up|down|status"""

import sys

from .cli import main

sys.exit(main())
