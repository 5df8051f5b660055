"""A test PKI: a CA, a server-and-client certificate for 127.0.0.1 it signed, and a
rogue one signed by another CA (``pki``, a pytest fixture: import it into a test
module)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Pki", "issue", "pki"]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def issue(
    d: Path, name: str, issuer: tuple[str, Any] | None, *, ca: bool = False
) -> tuple[Path, Path, Any]:
    """``name``.pem and ``name``.key in ``d``, signed by ``issuer`` (None: itself);
    a leaf names 127.0.0.1 and serves and authenticates (a server of a replica set
    is a client of its primary)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, issuer_key = issuer or (name, key)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        ip = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
        b = b.add_extension(x509.SubjectAlternativeName([ip]), critical=False)
    cert = b.sign(issuer_key, hashes.SHA256())
    pem, pem_key = d / f"{name}.pem", d / f"{name}.key"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem_key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pem, pem_key, key


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path  # a server's, signed by ca
    key: Path
    rogue_cert: Path  # signed by another CA
    rogue_key: Path

    def flags(
        self, cert: Path | None = None, key: Path | None = None
    ) -> tuple[str, ...]:
        """A server with mutual TLS: clients (standbys too) show a certificate."""
        return (
            "--tls-cert", str(cert or self.cert), "--tls-key", str(key or self.key),
            "--tls-client-ca", str(self.ca),
        )  # fmt: skip

    def client(self) -> dict[str, Any]:
        return {
            "root_certificates": self.ca.read_bytes(),
            "certificate_chain": self.cert.read_bytes(),
            "private_key": self.key.read_bytes(),
        }


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    d = tmp_path / "pki"
    d.mkdir()
    ca, _, ca_key = issue(d, "replica-ca", None, ca=True)
    _, _, rogue_ca_key = issue(d, "rogue-ca", None, ca=True)
    cert, key, _ = issue(d, "server", ("replica-ca", ca_key))
    rogue_cert, rogue_key, _ = issue(d, "rogue", ("rogue-ca", rogue_ca_key))
    return Pki(ca, cert, key, rogue_cert, rogue_key)
