"""A test PKI: a CA, a server-and-client certificate for 127.0.0.1 it signed, and a
rogue one signed by another CA (``pki``, the fixture in
tests/conftest.py, makes one per test)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Pki", "_cert", "_key", "_pem", "_pem_key", "_pki", "issue"]


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


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        usage = (
            ExtendedKeyUsageOID.SERVER_AUTH
            if server
            else (ExtendedKeyUsageOID.CLIENT_AUTH)
        )
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
    return b.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pki(d: Path) -> None:
    """tls.crt, tls.key and ca.crt, as the onnxps-tls Secret would mount them."""
    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key: Any, issuer_key: Any, ca: bool) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(
                x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "onnxps test CA")])
            )
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), True)
        )
        if not ca:
            names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            b = b.add_extension(x509.SubjectAlternativeName(names), False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    pem = serialization.Encoding.PEM
    (d / "ca.crt").write_bytes(
        cert("onnxps test CA", ca_key, ca_key, True).public_bytes(pem)
    )
    (d / "tls.crt").write_bytes(cert("shard", key, ca_key, False).public_bytes(pem))
    (d / "tls.key").write_bytes(
        key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
