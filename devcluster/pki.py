"""The kubelet API's certificates: one cluster CA (made at `up`), the API server's client
certificate and each simulated node's serving certificate, all signed by it (openssl, P-256).

The API server verifies a node's serving certificate (`--kubelet-certificate-authority`, the
node IP as IP SAN), and the node's kubelet API accepts only clients with a certificate of this
CA whose name is the API server's (mTLS, see agent/kubeletapi.py for why).
"""

from __future__ import annotations

import base64
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: the API server's name as a kubelet client (kubeadm's spelling)
APISERVER_CLIENT_CN = "kube-apiserver-kubelet-client"
_DAYS = "3650"


@dataclass(frozen=True)
class _CertificateAuthority:
    """A CA's key and certificate in `folder` (made 0700: root's alone)."""

    folder: Path

    @property
    def ca_cert(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    def _create_ca(self, common_name: str) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _openssl(
            self.ca_key,
            self.ca_cert,
            f"/CN={common_name}",
            "basicConstraints=critical,CA:TRUE",
            "keyUsage=critical,keyCertSign,cRLSign",
        )


@dataclass(frozen=True)
class KubeletPKI(_CertificateAuthority):
    """Where the files are: STATE/secrets/kubelet/ (root's alone, like the rest of secrets/)."""

    @property
    def client_cert(self) -> Path:
        return self.folder / "apiserver-kubelet-client.crt"

    @property
    def client_key(self) -> Path:
        return self.folder / "apiserver-kubelet-client.key"

    def create(self) -> None:
        """The CA and the API server's client certificate (at `up`, before the API server)."""
        self._create_ca("gpulab-dev-kubelet-ca")
        _openssl(
            self.client_key,
            self.client_cert,
            f"/O=system:masters/CN={APISERVER_CLIENT_CN}",
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature",
            "extendedKeyUsage=clientAuth",
            ca=self,
        )

    def sign_serving(self, node: str, ip: str, key: Path, cert: Path) -> None:
        """A node's serving certificate for `ip` (the address its Node object reports)."""
        _openssl(
            key,
            cert,
            f"/O=system:nodes/CN=system:node:{node}",
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature",
            "extendedKeyUsage=serverAuth",
            f"subjectAltName=IP:{ip},DNS:{node}",
            ca=self,
        )


@dataclass(frozen=True)
class LoopbackPKI(_CertificateAuthority):
    """A CA and one serving certificate for 127.0.0.1, for a controller that serves admission
    and conversion webhooks on this machine's loopback (the API server runs here too, so a
    webhook's `clientConfig.url` can name https://127.0.0.1:PORT). The file names are
    controller-runtime's defaults (`tls.crt`, `tls.key` in the cert dir)."""

    @property
    def cert_dir(self) -> Path:
        return self.folder / "serving"

    def create(self, name: str) -> None:
        self._create_ca(f"gpulab-dev-{name}-webhook-ca")
        self.cert_dir.mkdir(mode=0o700, exist_ok=True)
        _openssl(
            self.cert_dir / "tls.key",
            self.cert_dir / "tls.crt",
            f"/CN={name}-webhook",
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature",
            "extendedKeyUsage=serverAuth",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            ca=self,
        )

    def ca_bundle(self) -> str:
        """The CA certificate, base64, as `clientConfig.caBundle` takes it."""
        return base64.b64encode(self.ca_cert.read_bytes()).decode()


def _openssl(
    key: Path,
    cert: Path,
    subject: str,
    *extensions: str,
    ca: _CertificateAuthority | None = None,
):
    cmd = [
        "openssl", "req", "-x509", "-new", "-newkey", "ec",
        "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", _DAYS, "-subj", subject,
    ]  # fmt: skip
    if ca is not None:
        cmd += ["-CA", str(ca.ca_cert), "-CAkey", str(ca.ca_key)]
    for ext in extensions:
        cmd += ["-addext", ext]
    key.touch(mode=0o600)  # never readable by others, not even between the write and a chmod
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl could not make {cert.name}: {done.stderr.strip()[-500:]}")
    key.chmod(0o600)
