"""Test harness: real hubs, dev clusters, lab servers, browsers, waits and ports, for tests and benchmarks."""
