"""Dask GPU clusters inside the hub: the cluster service, its executor contract, and its start
with the hub (decision record 0003; the pure core is ``gpulab.hub.dask``)."""
