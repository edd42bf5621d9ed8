"""The ``gpulab-metrics`` hub service: servers push GPU figures, admins read them and alerts."""
