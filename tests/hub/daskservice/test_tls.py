"""A cluster's credentials (``make_cluster_tls``): a certificate that is its own CA, accepted by
a peer holding the same credentials and refused with another cluster's or none (the handshake
that Dask's ``Security`` sets up: mutual, no host name check)."""

from __future__ import annotations

import asyncio
import ssl
import tempfile
from pathlib import Path

import pytest
from cryptography import x509

from gpulab.hub.daskservice.executor import ClusterTLS
from gpulab.hub.daskservice.tls import make_cluster_tls


def _context(tls: ClusterTLS, purpose: ssl.Purpose, folder: Path) -> ssl.SSLContext:
    """As ``distributed.Security._get_tls_context`` builds it."""
    cert, key = folder / f"{id(tls)}.crt", folder / f"{id(tls)}.key"
    cert.write_text(tls.cert_pem)
    key.write_text(tls.key_pem)
    ctx = ssl.create_default_context(purpose=purpose, cadata=tls.cert_pem)
    ctx.load_cert_chain(cert, key)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = False
    return ctx


async def _handshake(server: ClusterTLS, client: ClusterTLS | None) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        server_ctx = _context(server, ssl.Purpose.CLIENT_AUTH, folder)
        if client is None:  # a client that trusts the cluster's CA but presents no certificate
            client_ctx = ssl.create_default_context(cadata=server.cert_pem)
            client_ctx.check_hostname = False
        else:
            client_ctx = _context(client, ssl.Purpose.SERVER_AUTH, folder)
        accepted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"hello")
            await writer.drain()
            writer.close()

        srv = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
        port = srv.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
            try:
                accepted.set_result(await reader.read(5) == b"hello")
            except (ssl.SSLError, ConnectionError):
                accepted.set_result(False)  # TLS 1.3: the server refuses after the handshake
            writer.close()
        except (ssl.SSLError, ConnectionError):
            accepted.set_result(False)
        finally:
            srv.close()
        return accepted.result()


def test_certificate_is_its_own_ca_for_server_and_client() -> None:
    tls = make_cluster_tls("dask-alice-7")
    cert = x509.load_pem_x509_certificate(tls.cert_pem.encode())
    assert cert.issuer == cert.subject
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {u.dotted_string for u in usages} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}
    assert "dask-alice-7" in cert.subject.rfc4514_string()
    assert "PRIVATE KEY" in tls.key_pem


def test_every_cluster_gets_a_new_key() -> None:
    assert make_cluster_tls("a").key_pem != make_cluster_tls("a").key_pem


async def test_same_credentials_accepted_others_and_none_refused() -> None:
    mine, theirs = make_cluster_tls("dask-alice-1"), make_cluster_tls("dask-bob-1")
    assert await _handshake(mine, mine)
    assert not await _handshake(mine, theirs)
    assert not await _handshake(mine, None)


@pytest.mark.parametrize("name", ["", "x" * 65])
def test_bad_common_name_refused(name: str) -> None:
    with pytest.raises(ValueError, match="common_name"):
        make_cluster_tls(name)
