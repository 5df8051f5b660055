"""The address of a replicated cluster's etcd, as servers and clients name it.

``etcd://HOST:PORT[,HOST:PORT]/PREFIX`` talks plain HTTP to etcd's JSON gateway;
``etcds://...`` talks HTTPS: the etcd's certificate is checked against
``ONNXPS_COORDINATOR_CA`` (a PEM file; the system's roots when unset), and with
``ONNXPS_COORDINATOR_CERT`` and ``ONNXPS_COORDINATOR_KEY`` the client presents that
certificate (etcd's ``--client-cert-auth``). ``onnxps serve`` takes the same files
as ``--coordinator-ca``, ``--coordinator-cert`` and ``--coordinator-key``.

The servers (``onnxps.server.replication``), ``Client("etcd://...")`` and
``onnxps status`` all parse the address here, so they accept the same ones.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "SCHEMES",
    "CoordinatorAddress",
    "CoordinatorTls",
    "failure",
    "gateway_clients",
    "is_coordinator",
    "parse_coordinator",
]

SCHEMES = ("etcd", "etcds")

EXPECTED = "expected etcd://HOST:PORT[,HOST:PORT]/PREFIX (etcds:// for TLS)"


@dataclass(frozen=True)
class CoordinatorTls:
    """What an ``etcds://`` client checks and presents: PEM file paths."""

    ca: str | None = None  # None: the system's roots
    cert: str | None = None  # a client certificate, with ``key``
    key: str | None = None

    @classmethod
    def from_env(cls) -> CoordinatorTls:
        """The files named by ``ONNXPS_COORDINATOR_CA``, ``_CERT`` and ``_KEY``."""
        return cls(
            os.environ.get("ONNXPS_COORDINATOR_CA") or None,
            os.environ.get("ONNXPS_COORDINATOR_CERT") or None,
            os.environ.get("ONNXPS_COORDINATOR_KEY") or None,
        )

    def check(self) -> None:
        """ValueError saying what is wrong: a file missing, or half a key pair."""
        if (self.cert is None) != (self.key is None):
            raise ValueError(
                "a client certificate for etcd needs both the certificate and its "
                f"key (got certificate {self.cert!r}, key {self.key!r})"
            )
        for what, path in (("CA", self.ca), ("certificate", self.cert),
                           ("key", self.key)):  # fmt: skip
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"the etcd {what} file {path!r} does not exist")


@dataclass(frozen=True)
class CoordinatorAddress:
    """``etcd[s]://H:P[,H:P]/PREFIX``: etcd endpoints and the key prefix of a cluster;
    ``tls`` set for ``etcds://``."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str  # "/name", no trailing slash
    tls: CoordinatorTls | None = None

    def __str__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"{'etcds' if self.tls else 'etcd'}://{hosts}{self.prefix}"


def is_coordinator(address: object) -> bool:
    """Whether ``address`` names a replicated cluster's etcd."""
    return isinstance(address, str) and address.startswith(("etcd://", "etcds://"))


def parse_coordinator(
    url: str, tls: CoordinatorTls | None = None
) -> CoordinatorAddress:
    """Parse ``etcd[s]://H:P[,H:P]/PREFIX``; ValueError saying what is expected.
    ``tls``: the files of an ``etcds://`` address (none: the environment's,
    ``CoordinatorTls.from_env``); given with ``etcd://``, an error (say
    ``etcds://`` to use them)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or not parts.netloc:
        raise ValueError(f"{EXPECTED}, got {url!r}")
    endpoints = []
    for hostport in parts.netloc.split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{EXPECTED}, got {url!r} ({hostport!r} is no HOST:PORT)")
        endpoints.append((host.strip("[]"), int(port)))
    prefix = "/" + parts.path.strip("/")
    if prefix == "/":
        raise ValueError(f"{EXPECTED}, got {url!r} (the PREFIX is missing)")
    if parts.scheme == "etcd":
        if tls is not None and tls != CoordinatorTls():
            raise ValueError(
                f"etcd TLS files were given for the plaintext address {url!r}: "
                "write etcds:// to talk TLS to etcd"
            )
        return CoordinatorAddress(tuple(endpoints), prefix)
    tls = tls if tls is not None else CoordinatorTls.from_env()
    tls.check()
    return CoordinatorAddress(tuple(endpoints), prefix, tls)


def gateway_clients(address: CoordinatorAddress, timeout: float) -> list[Any]:
    """One ``etcd3gw`` client per endpoint (HTTPS with the address's TLS files for
    ``etcds://``). ImportError without the ``replication`` extra."""
    import etcd3gw

    return [
        etcd3gw.Etcd3Client(
            host=h,
            port=p,
            timeout=timeout,
            api_path="/v3/",
            protocol="https" if address.tls else "http",
            session=_session(address.tls),
        )
        for h, p in address.endpoints
    ]


def _session(tls: CoordinatorTls | None) -> Any:
    """A requests session that checks etcd against ``tls.ca``. requests lets
    ``REQUESTS_CA_BUNDLE`` or ``CURL_CA_BUNDLE`` in the environment override a
    session's CA (psf/requests#3829), and many images set them to the system's
    roots: a cluster CA given here is used all the same."""
    import requests

    class Session(requests.Session):
        def merge_environment_settings(self, *args: Any, **kwargs: Any) -> Any:
            settings = super().merge_environment_settings(*args, **kwargs)
            if tls is not None and tls.ca is not None:
                settings["verify"] = tls.ca
            return settings

    session = Session()
    if tls is not None and tls.cert is not None and tls.key is not None:
        session.cert = (tls.cert, tls.key)
    return session


def failure(exc: BaseException) -> str:
    """What went wrong in a call to etcd: ``etcd3gw`` raises its errors without
    their cause's text; the TLS or connection error under it, when there is one."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for e in reversed(chain):  # the innermost first
        if isinstance(e, ssl.SSLError):
            return f"TLS: {e}"
    for e in reversed(chain):
        if isinstance(e, OSError) and str(e):
            return str(e)
    return repr(exc)
