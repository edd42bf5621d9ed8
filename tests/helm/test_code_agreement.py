"""What the chart renders agrees with what gpulab's code expects or would make itself: the hub's
config is a valid gpulab config (the rendered jupyterhub_config.py, loaded as JupyterHub loads
it), the PriorityClasses are the spawner's tiers, the NetworkPolicies are the ones the spawner
would create (built here by its own code from the rendered config), the placeholders ask for
what a server of their profile asks for, and the catalog is gpulab's default one."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import yaml
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.config import GPULab, GPULabHubHooks
from gpulab.hub.profiles import DEFAULT_CATALOG, parse_catalog
from gpulab.spawner.kube import GPUKubeSpawner
from gpulab.spawner.kube.gpu_resources import gpu_spec
from gpulab.spawner.kube.isolation import KubeIsolationMixin
from gpulab.spawner.kube.objects import priority_class_manifest
from gpulab.spawner.kube.state import _holds_gpus
from gpulab.spawner.names import JOB_COMPONENT, PLACEHOLDER_LABEL, PUSH_URL_ENV
from tests.helm.conftest import find


def hub_config(objects: list[dict[str, Any]], folder: Path, env: dict[str, str]) -> Config:
    """The hub's config as JupyterHub loads it from the rendered ConfigMap and the extra config
    snippets of the hub's Secret, as the hub's projected volume puts them (apply(c) included)."""
    (configmap,) = find(objects, "ConfigMap")
    for name, text in configmap["data"].items():
        (folder / name).write_text(text)
    (secret,) = find(objects, "Secret")
    for name, encoded in secret["data"].items():
        if name.startswith("extra-config-"):
            (folder / name).write_text(base64.b64decode(encoded).decode())
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        loader = PyFileConfigLoader("jupyterhub_config.py", path=str(folder))
        return loader.load_config()


@pytest.fixture
def default_config(default_objects: list[dict[str, Any]], tmp_path: Path) -> Config:
    return hub_config(
        default_objects, tmp_path, {"POD_IP": "10.1.2.3", "GPULAB_METRICS_PORT": "8002"}
    )


def traits_of(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    (configmap,) = find(objects, "ConfigMap")
    return dict(yaml.safe_load(configmap["data"]["gpulab-traits.yaml"]))


def spawner_settings(config: Config) -> Any:
    """GPUKubeSpawner's isolation options from `config`, its defaults for the rest."""
    traits = GPUKubeSpawner.class_traits(config=True)
    settings = {name: trait.default() for name, trait in traits.items()}
    settings.update(config.KubeSpawner)
    settings.update(config.GPUKubeSpawner)
    env = config.Spawner.environment
    environment = env if isinstance(env, dict) else copy.deepcopy(env).get_value({})
    return settings, environment


# -- the hub's config ------------------------------------------------------------------------------


def test_the_config_file_makes_a_gpulab_hub_on_kubernetes(default_config: Config) -> None:
    c = default_config
    assert c.JupyterHub.spawner_class == "gpulab.spawner.kube.GPUKubeSpawner"
    assert issubclass(c.JupyterHub.authenticator_class, GPULabHubHooks)  # apply(c) ran last
    assert c.JupyterHub.hub_connect_url == "http://gpulab-hub:8081"
    assert c.ConfigurableHTTPProxy.api_url == "http://gpulab-proxy-api:8001"
    # gpulab-metrics listens on the pod's address, servers push through the hub Service
    assert c.GPULab.metrics_service_url == "http://10.1.2.3:8002"
    _, environment = spawner_settings(c)
    assert environment[PUSH_URL_ENV] == "http://gpulab-hub:8002/api/push"
    # the catalog and quotas load as the hub loads them at start
    capacity = GPUCapacity(config=c)
    assert [p.slug for p in capacity.catalog] == [p["slug"] for p in DEFAULT_CATALOG]


def test_postgresql_and_extra_config_reach_the_hub(check: ModuleType, tmp_path: Path) -> None:
    url = "postgresql://gpulab:pw@db:5432/gpulab"
    values = {
        "hub": {
            "db": {"type": "postgresql", "url": url},
            "extraConfig": {"10-banner": 'c.JupyterHub.template_vars = {"announcement": "hi"}'},
        }
    }
    objects = check.manifests(check.render(values))
    c = hub_config(objects, tmp_path, {"GPULAB_DB_URL": url})
    assert c.JupyterHub.db_url == "postgresql+psycopg://gpulab:pw@db:5432/gpulab"
    assert c.GPUJobs.db_url == c.GPUDask.db_url == c.GPULedger.db_url == url
    assert c.JupyterHub.template_vars == {"announcement": "hi"}
    # the snippet is in the Secret only, and the hub's config volume projects it from there
    (configmap,) = find(objects, "ConfigMap")
    assert "announcement" not in str(configmap["data"])
    (hub,) = find(objects, "Deployment", "gpulab-hub")
    (volume,) = [v for v in hub["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    (from_secret,) = [s["secret"] for s in volume["projected"]["sources"] if "secret" in s]
    assert from_secret["items"] == [
        {"key": "extra-config-10-banner.py", "path": "extra-config-10-banner.py"}
    ]


def test_the_jobs_platform_failure_settings_reach_the_hub(
    check: ModuleType, tmp_path: Path
) -> None:
    jobs = {"kernelStartTimeoutSeconds": 240, "platformRetryBackoffSeconds": 0.5}
    c = hub_config(check.manifests(check.render({"gpulab": {"jobs": jobs}})), tmp_path, {})
    assert c.GPUJobs.kernel_start_timeout_seconds == 240
    assert c.GPUJobs.platform_retry_backoff_seconds == 0.5


@pytest.mark.parametrize("values_name", ["default", "all options"])
def test_every_trait_the_chart_sets_exists_and_is_configurable(
    default_objects: list[dict[str, Any]],
    all_options_objects: list[dict[str, Any]],
    values_name: str,
) -> None:
    from jupyterhub.app import JupyterHub
    from jupyterhub.auth import Authenticator
    from jupyterhub.proxy import ConfigurableHTTPProxy
    from jupyterhub.spawner import Spawner
    from nativeauthenticator import NativeAuthenticator

    from gpulab.hub.daskservice.hub import GPUDask
    from gpulab.hub.jobservice.hub import GPUJobs
    from gpulab.hub.ledgerservice import GPULedger
    from gpulab.hub.warmpoolservice import GPUWarmPool

    classes = {
        cls.__name__: cls
        for cls in (
            JupyterHub,
            ConfigurableHTTPProxy,
            Authenticator,
            NativeAuthenticator,
            Spawner,
            GPUKubeSpawner,
            GPUCapacity,
            GPULab,
            GPUJobs,
            GPUDask,
            GPULedger,
            GPUWarmPool,
        )
    }
    objects = default_objects if values_name == "default" else all_options_objects
    for class_name, traits in traits_of(objects).items():
        configurable = classes[class_name].class_traits(config=True)
        unknown = set(traits) - set(configurable)
        assert not unknown, f"{class_name} has no option {sorted(unknown)}"
        # values the traits accept (a Dict, List, Bool... of the right type)
        c = Config({class_name: traits})
        if class_name in (
            "GPUCapacity",
            "GPULab",
            "GPUJobs",
            "GPUDask",
            "GPULedger",
            "GPUWarmPool",
        ):
            classes[class_name](config=c)


def test_every_options_profiles_load_as_the_hub_loads_them(
    all_options_objects: list[dict[str, Any]],
) -> None:
    traits = traits_of(all_options_objects)["GPUCapacity"]
    assert [p.slug for p in parse_catalog(traits["profiles"])] == [
        "cpu",
        "a100-quarter",
        "h100-1",
        "gpu-4",
    ]


def test_every_options_warm_pools_name_profiles_of_its_catalog(
    all_options_objects: list[dict[str, Any]],
) -> None:
    from gpulab.hub.warmpool import parse_pools
    from gpulab.hub.warmpoolservice import GPUWarmPool

    traits = traits_of(all_options_objects)
    catalog = [p.slug for p in parse_catalog(traits["GPUCapacity"]["profiles"])]
    pool = GPUWarmPool(config=Config({"GPUWarmPool": traits["GPUWarmPool"]}))
    specs = parse_pools(pool.pools, catalog)
    assert [(s.profile, s.min, s.max) for s in specs] == [("a100-quarter", 1, 2)]
    assert pool.gpu_quota == 1 and pool.timezone == "Europe/Berlin"


def test_the_default_catalog_is_gpulabs(check: ModuleType) -> None:
    values = yaml.safe_load((check.CHART / "values.yaml").read_text())
    assert values["gpulab"]["profiles"] == DEFAULT_CATALOG


# -- priority classes ------------------------------------------------------------------------------


def test_the_priority_classes_are_the_spawners_tiers(
    default_objects: list[dict[str, Any]], default_config: Config
) -> None:
    tiers = GPUKubeSpawner.class_traits()["priority_classes"].default()
    made = {
        o["metadata"]["name"]: {k: v for k, v in o.items() if k != "metadata"}
        for o in find(default_objects, "PriorityClass")
    }
    expected = {}
    for priority, (name, value) in tiers.items():
        manifest = priority_class_manifest(name, value, priority)
        expected[name] = {k: v for k, v in manifest.items() if k != "metadata"}
    assert made == expected
    assert default_config.GPUKubeSpawner.priority_classes == tiers
    # the pure builders' own fallback names them alike
    for priority, (name, _) in tiers.items():
        spec = gpu_spec(
            num_gpu=1,
            gpu_milli=0,
            gpu_models=[],
            gpu_memory_mib=0,
            sharing="mig",
            priority=priority,
        )
        assert spec.priority_class_name == name


def test_renamed_priority_classes_are_named_to_the_spawner(
    all_options_objects: list[dict[str, Any]], lint_values: dict[str, Any]
) -> None:
    classes = lint_values["gpulab"]["priorityClasses"]
    configured = traits_of(all_options_objects)["GPUKubeSpawner"]["priority_classes"]
    assert configured == {
        "on-demand": [classes["onDemand"]["name"], classes["onDemand"]["value"]],
        "preemptible": [classes["preemptible"]["name"], classes["preemptible"]["value"]],
    }
    names = {o["metadata"]["name"] for o in find(all_options_objects, "PriorityClass")}
    assert {classes["onDemand"]["name"], classes["preemptible"]["name"]} <= names


# -- NetworkPolicies -------------------------------------------------------------------------------


def spawners_policies(config: Config) -> list[dict[str, Any]]:
    """The servers' and job pods' NetworkPolicies as GPUKubeSpawner would create them with this
    config (its own methods, on its options)."""
    settings, environment = spawner_settings(config)
    settings["environment"] = environment
    spawner = SimpleNamespace(
        **settings,
        hub=SimpleNamespace(api_url=config.JupyterHub.hub_connect_url.rstrip("/") + "/hub/api"),
    )
    spawner._hub_ports = lambda: KubeIsolationMixin._hub_ports(spawner)  # type: ignore[arg-type]
    spawner._push_ports = lambda: KubeIsolationMixin._push_ports(spawner)  # type: ignore[arg-type]
    spawner.network_policy_manifest = lambda: KubeIsolationMixin.network_policy_manifest(spawner)  # type: ignore[arg-type]
    spawner.job_network_policy_name = f"{spawner.network_policy_name}-jobs"
    return [
        KubeIsolationMixin.network_policy_manifest(spawner),  # type: ignore[arg-type]
        KubeIsolationMixin.job_network_policy_manifest(spawner),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("values_name", ["default", "all options"])
def test_the_network_policies_are_the_ones_the_spawner_would_create(
    check: ModuleType,
    lint_values: dict[str, Any],
    tmp_path: Path,
    values_name: str,
) -> None:
    values = {} if values_name == "default" else lint_values
    objects = check.manifests(check.render(values))
    if values_name != "default":  # its authenticator (generic-oauth) is not installed here
        values = copy.deepcopy(values)
        values["hub"]["authenticatorClass"] = "gpulab"
        values["hub"]["extraConfig"] = {}
        values["hub"]["db"] = {"type": "sqlite-pvc", "url": ""}
        objects = check.manifests(check.render(values))
    port = str(values.get("gpulab", {}).get("metrics", {}).get("port", 8002))
    config = hub_config(objects, tmp_path, {"POD_IP": "10.1.2.3", "GPULAB_METRICS_PORT": port})
    assert config.GPUKubeSpawner.network_policy is False  # the chart ships them
    rendered = {o["metadata"]["name"]: o for o in find(objects, "NetworkPolicy")}
    for expected in spawners_policies(config):
        name = expected["metadata"]["name"]
        assert rendered[name]["spec"] == expected["spec"], name
    assert expected["spec"]["podSelector"]["matchLabels"]["component"] == JOB_COMPONENT


def test_without_the_charts_policies_the_hub_may_write_its_own(check: ModuleType) -> None:
    def network_rules(values: dict[str, Any]) -> list[dict[str, Any]]:
        (role,) = find(check.manifests(check.render(values)), "Role")
        return [r for r in role["rules"] if "networkpolicies" in r["resources"]]

    assert network_rules({}) == []  # least privilege: the chart made them
    off = {"singleuser": {"networkPolicy": {"enabled": False}}}
    (rule,) = network_rules(off)
    assert {"get", "create", "update"} <= set(rule["verbs"])


# -- GPU placeholders ------------------------------------------------------------------------------


def test_placeholders_ask_for_what_a_server_of_their_profile_asks_for(
    all_options_objects: list[dict[str, Any]], lint_values: dict[str, Any]
) -> None:
    sharing = lint_values["gpulab"]["sharing"]
    profiles = {p.slug: p for p in parse_catalog(lint_values["gpulab"]["profiles"])}
    placeholders = [
        d
        for d in find(all_options_objects, "Deployment")
        if d["metadata"]["labels"]["component"] == "gpu-placeholder"
    ]
    assert len(placeholders) == len(lint_values["placeholders"]["profiles"])
    classes = {
        o["metadata"]["name"]: o["value"] for o in find(all_options_objects, "PriorityClass")
    }
    lowest_tier = lint_values["gpulab"]["priorityClasses"]["preemptible"]["value"]
    for deployment in placeholders:
        slug = deployment["metadata"]["labels"]["gpulab.io/profile"]
        wanted = lint_values["placeholders"]["profiles"][slug]
        assert deployment["spec"]["replicas"] == wanted["count"]
        profile = profiles[slug]
        spec = gpu_spec(
            num_gpu=profile.num_gpu,
            gpu_milli=profile.gpu_milli,
            gpu_models=profile.gpu_models,
            gpu_memory_mib=81920,
            sharing=sharing,
            priority=profile.priority,
        )
        pod = deployment["spec"]["template"]
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["limits"] == resources["requests"] == spec.limits, slug
        terms = pod["spec"].get("affinity", {}).get("nodeAffinity", {})
        required = terms.get("requiredDuringSchedulingIgnoredDuringExecution", {})
        assert required.get("nodeSelectorTerms", []) == spec.node_affinity_required, slug
        assert pod["spec"].get("tolerations", []) == spec.tolerations, slug
        # below every tier, so any server preempts it; and not counted as held by the allocator
        assert classes[pod["spec"]["priorityClassName"]] < lowest_tier
        assert pod["metadata"]["labels"][PLACEHOLDER_LABEL] == "true"
        assert not _holds_gpus(
            {"metadata": pod["metadata"], "spec": {**pod["spec"], "nodeName": "n"}}
        )
