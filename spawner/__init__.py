"""gpulab spawners: the local GPU spawner and the shared profile -> allocation -> environment logic."""
