"""gpulab's REST endpoints under /hub/api/gpulab/ (one module per resource)."""
