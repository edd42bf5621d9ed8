"""Former name of the metrics service: ``python -m gpulab.hub.metrics_service`` keeps working.

The service is `gpulab.hub.services.metrics` (``python -m gpulab.hub.services.metrics``).
"""

if __name__ == "__main__":
    from gpulab.hub.services.metrics.service import main

    main()
