"""The one config function: `apply(c)` makes any JupyterHub a gpulab hub, whatever its authenticator.

The embedded default (`hub/jupyterhub_config.py`) and a cluster deployment (a z2jh-style config
with OAuthenticator, say) both end with::

    from gpulab.hub.config import apply
    apply(c)

It must come LAST in the config file, after every setting it reads (the authenticator class, the
GPU profiles and quotas), and it registers:

- gpulab's REST endpoints (`/hub/api/gpulab/...`) and pages (`/hub/gpulab/workspaces`) as
  `c.JupyterHub.extra_handlers`;
- gpulab's checks in front of JupyterHub's own server handlers (reserved names, bounded bodies, no
  record left by a refused first start). JupyterHub routes an authenticator's handlers first, its
  own next and extra handlers last (`JupyterHub.init_handlers`), so these can only come first
  through the authenticator: the configured class is extended with `GPULabHubHooks`, which also
  makes expected refusals one log line and checks the GPU configuration when the hub starts (a
  mistake stops the hub with a message naming the option, before anyone spawns).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from jupyterhub.auth import Authenticator
from traitlets import TraitError
from traitlets.config import Config
from traitlets.utils.importstring import import_item

from gpulab.hub.apihandlers.gpulab import gpulab_handlers
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.handlers.servers import server_handler_overrides
from gpulab.hub.inventory import InventoryError
from gpulab.hub.profiles import ProfileError
from gpulab.hub.refusals import install_quiet_refusals

#: JupyterHub's own default when a config names no authenticator
DEFAULT_AUTHENTICATOR = "pam"


class GPULabHubHooks(Authenticator):
    """What gpulab needs from the hub's authenticator, for any authenticator class.

    `apply(c)` puts this in front of the configured class (`GPULabAuthenticator` has it already):
    the server checks go before JupyterHub's own routes, a refused spawn is one log line, and the
    GPU configuration is loaded at hub start.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # the hub's logger (spawners and handlers log there): a refused spawn is one line
        install_quiet_refusals(self.log)
        self.check_gpu_configuration()

    def check_gpu_configuration(self) -> None:
        """Load the GPU inventory, catalog and quotas at hub start, so that a configuration
        mistake stops the hub with a message naming the option instead of failing the first
        spawn."""
        try:
            GPUCapacity.instance(config=self.config, log=self.log)
        except (ProfileError, InventoryError, TraitError, ValueError) as e:
            self.log.critical("gpulab configuration error: %s", e)
            raise SystemExit(1) from None

    def get_handlers(self, app: Any) -> list[Any]:
        return server_handler_overrides + list(super().get_handlers(app))


def authenticator_class(configured: Any) -> type[Authenticator]:
    """The class a `JupyterHub.authenticator_class` value names: a class, an entry point name of
    `jupyterhub.authenticators` ("dummy", "pam", "github"...) or a dotted import path."""
    if isinstance(configured, type):
        return configured
    name = str(configured or DEFAULT_AUTHENTICATOR)
    for ep in entry_points(group="jupyterhub.authenticators"):
        if ep.name == name:
            return ep.load()  # type: ignore[no-any-return]
    if "." not in name:
        raise ValueError(
            f"JupyterHub.authenticator_class {name!r} is neither an installed authenticator's "
            "entry point name nor a dotted class path"
        )
    return import_item(name)  # type: ignore[no-any-return]


def with_hub_hooks(cls: type[Authenticator]) -> type[Authenticator]:
    """`cls` with `GPULabHubHooks` in front, or `cls` itself when it has them already. The new
    class keeps `cls`'s name, so `c.<ClassName>.option` settings and its log lines read the same."""
    if issubclass(cls, GPULabHubHooks):
        return cls
    return type(cls.__name__, (GPULabHubHooks, cls), {"__module__": cls.__module__})


def apply(c: Config) -> None:
    """Make the hub configured in `c` a gpulab hub (see the module docstring). Call it last."""
    configured = c.JupyterHub.get("authenticator_class", DEFAULT_AUTHENTICATOR)
    c.JupyterHub.authenticator_class = with_hub_hooks(authenticator_class(configured))
    extra = list(c.JupyterHub.get("extra_handlers", []))
    routes = {route for route, *_ in extra}
    c.JupyterHub.extra_handlers = extra + [h for h in gpulab_handlers if h[0] not in routes]


__all__ = ["GPULabHubHooks", "apply", "authenticator_class", "with_hub_hooks"]
