"""python -m gpulab.hub.services.metrics"""

from gpulab.hub.services.metrics.service import main

main()
