"""Fixtures of the GPUKubeSpawner unit tests: a spawner made without a cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.config import kube_config
from kubespawner import clients

OFFLINE_KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: nowhere, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: nobody, user: {token: unused}}]
contexts: [{name: nowhere, context: {cluster: nowhere, user: nobody}}]
current-context: nowhere
"""


@pytest.fixture
def offline_kube_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """KubeSpawner loads a kubeconfig when it is made (it connects only when used): one that
    points nowhere, and the client's global configuration as it was afterwards."""
    path = tmp_path / "kubeconfig"
    path.write_text(OFFLINE_KUBECONFIG)
    # read from KUBECONFIG when kubernetes_asyncio is imported, so set where it was kept
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    saved = Configuration.get_default_copy()
    clients.load_config.cache_clear()
    yield
    clients.load_config.cache_clear()
    Configuration.set_default(saved)
