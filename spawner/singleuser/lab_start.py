"""A gpulab server's JupyterLab starts without asking yarn for an npm registry.

Importing `jupyterlab.labapp`, which every server serving the lab does while Jupyter Server
finds its extensions, calls `get_app_version()`; its `AppOptions()` computes the `registry`
default by running `node .../jupyter_builder/yarn.js config --json`: about 0.35 s of CPU and
0.5-2 s of wall time on a busy machine, on every cold start, before the server answers. No
setting of JupyterLab reaches it: `AppOptions` is not configurable and the call runs at import.
A lab needs no npm registry to start or to serve: extensions come prebuilt or from PyPI (the
extension manager's default `pypi` provider); the registry is only used to build source
extensions or look up npm versions, which happens only when the user asks for a build.

So a gpulab server's configuration path holds one more directory (`CONFIG_DIR`: prepare adds it
to JUPYTER_CONFIG_PATH), whose `jupyter_server_config.py` Jupyter Server runs before it imports
any extension; it calls `pin_npm_registry`, which gives `AppOptions` the registry a user named
in the environment yarn itself reads (YARN_REGISTRY, npm_config_registry), else JupyterLab's own
fallback, without running yarn. A registry set only in ~/.yarnrc is then not seen by a build
started from the lab page (`jupyter lab build` in a terminal reads it as before).

Pure at import (stdlib): prepare, which runs in every image, imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: a Jupyter configuration directory of gpulab's: only `jupyter_server_config.py` (see above)
CONFIG_DIR = Path(__file__).resolve().parent / "jupyter_config"

#: the variables yarn reads a registry from, in its order, before its config files
REGISTRY_ENV = ("YARN_REGISTRY", "npm_config_registry")


def with_config_dir(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with `CONFIG_DIR` first on JUPYTER_CONFIG_PATH (the directories already named
    there are kept after it)."""
    env = dict(environ)
    paths = [p for p in env.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep) if p]
    if str(CONFIG_DIR) not in paths:
        env["JUPYTER_CONFIG_PATH"] = os.pathsep.join([str(CONFIG_DIR), *paths])
    return env


def pin_npm_registry(environ: Mapping[str, str] = os.environ) -> str | None:
    """Make JupyterLab's `AppOptions` default to a registry named without yarn; the registry,
    or None where JupyterLab is not installed or no longer computes it this way (then nothing
    is changed). Call it before `jupyterlab.labapp` is imported to keep the yarn call off the
    start."""
    try:
        from jupyterlab import commands
    except ImportError:
        return None  # a server without JupyterLab: nothing asks yarn
    options = getattr(commands, "AppOptions", None)
    fallback = getattr(commands, "YARN_DEFAULT_REGISTRY", None)
    if options is None or not isinstance(fallback, str) or "registry" not in options.class_traits():
        return None
    registry = next((environ[k] for k in REGISTRY_ENV if environ.get(k)), fallback)

    def registry_without_yarn(self: object) -> str:
        return registry

    # traitlets' dynamic default by name (`_<trait>_default`), which it prefers to the
    # `@default` generator that runs yarn; an explicit `AppOptions(registry=...)` still wins
    options._registry_default = registry_without_yarn
    return registry
