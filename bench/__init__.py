"""gpulab benchmarks (run as modules, e.g. ``python -m bench.allocator``)."""
