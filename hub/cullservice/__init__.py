"""GPU-aware culling inside the hub (`GPUCuller`): runs gpulab.hub.culling's policy every check;
the REST API is gpulab.hub.apihandlers.culling."""

from .hub import GPUCuller

__all__ = ["GPUCuller"]
