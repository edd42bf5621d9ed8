"""The empty-start rule (a start without options gets gpulab's default profile) is gpulab's
spawners' only: a stock spawner, or a Kubernetes spawner with an upstream profile_list, gets a
start's options as JupyterHub passes them (a stock KubeSpawner refuses a profile it does not
list with a 500)."""

from __future__ import annotations

from jupyterhub.spawner import SimpleLocalProcessSpawner
from kubespawner import KubeSpawner
from traitlets.config import Config

from gpulab.hub.handlers.servers import takes_gpulab_profiles
from gpulab.spawner.kube import GPUKubeSpawner
from gpulab.spawner.local.spawner import GPULocalSpawner, GPUSimpleLocalSpawner

UPSTREAM_PROFILES = [{"slug": "small", "display_name": "Small", "default": True}]


def test_gpulab_spawners_take_gpulab_profiles_and_stock_ones_do_not() -> None:
    config = Config()
    for spawner_class in (GPUKubeSpawner, GPULocalSpawner, GPUSimpleLocalSpawner):
        assert takes_gpulab_profiles(spawner_class, config), spawner_class
    for spawner_class in (KubeSpawner, SimpleLocalProcessSpawner):
        assert not takes_gpulab_profiles(spawner_class, config), spawner_class


def test_an_upstream_profile_list_in_either_section_keeps_kubespawners_own_default() -> None:
    for section in ("KubeSpawner", "GPUKubeSpawner"):
        config = Config({section: {"profile_list": UPSTREAM_PROFILES}})
        assert not takes_gpulab_profiles(GPUKubeSpawner, config), section
    callable_list = Config({"GPUKubeSpawner": {"profile_list": lambda spawner: UPSTREAM_PROFILES}})
    assert not takes_gpulab_profiles(GPUKubeSpawner, callable_list)
