"""Workspaces that come back: home volumes, snapshots, restore and clone, per backend."""
