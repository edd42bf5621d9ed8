"""A cluster's TLS credentials (``ClusterTLS``): one self-signed certificate that is its own CA.

Dask's mutual TLS (``distributed.Security``) checks that a peer's certificate was signed by the
configured CA and does not check host names (it expects a dedicated CA per cluster and IP
addresses, ``Security._get_tls_context``). So one key pair per cluster, whose certificate is
the CA, the scheduler's, every worker's and the client's at once, is enough: whoever holds it
is in the cluster (its owner, her processes and the hub's monitor), and any other certificate,
or none, is refused at the handshake. Another cluster's certificate is another CA: clusters
cannot reach each other.

Pure: ``cryptography`` only (no JupyterHub, tornado or Kubernetes), so the service, the
executors and the tests import it alike.
"""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpulab.hub.daskservice.executor import ClusterTLS

#: long enough for a kept-alive cluster (its idle timeout is capped at 7 days); a cluster whose
#: certificate expired would refuse its own workers, so this errs far on the long side
VALIDITY = datetime.timedelta(days=365)


def make_cluster_tls(common_name: str, *, validity: datetime.timedelta = VALIDITY) -> ClusterTLS:
    """New credentials for one cluster: a fresh P-256 key and a self-signed certificate, CA and
    leaf in one (``basicConstraints CA:TRUE``; server and client authentication), named
    ``common_name`` (e.g. ``dask-alice-7``: for people reading it, nothing checks it).

    The subject alternative names (localhost, 127.0.0.1, ::1) are for clients that do check host
    names; Dask does not. A new key every call: never reuse one across clusters."""
    if not common_name or len(common_name) > 64:
        raise ValueError(f"common_name must be 1 to 64 characters, got {common_name!r:.80}")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpulab dask cluster"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    # a minute back: a peer whose clock is slightly behind the hub's still accepts it at once
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=1)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return ClusterTLS(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode(),
    )
