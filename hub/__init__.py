"""gpulab hub side: profiles, inventory, allocator and JupyterHub configuration."""
