"""Transport security, token authentication and the safe-bind policy.

- ``check_bind_policy``: a server listens beyond loopback only with TLS and tokens,
  unless started with ``insecure`` (then it logs a WARNING).
- ``server_credentials``: TLS from a certificate and key; mutual TLS when a client CA
  is given (client certificates are then required and verified).
- ``TokenAuthInterceptor``: token authentication and authorization (roles and group-name
  prefixes) from a tokens file. See docs/SECURITY.md for the file format.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from onnxps.v1 import parameter_server_pb2 as pb

from ._handlers import (
    SERVICE,
    Call,
    CallHooks,
    Handler,
    HookInterceptor,
    Refusal,
    group_of,
    on_first,
)
from ._status import refuse

__all__ = [
    "ROLES",
    "ConfigError",
    "TokenAuthInterceptor",
    "TokenGrant",
    "check_bind_policy",
    "load_tokens",
    "parse_tokens",
    "server_credentials",
]

log = logging.getLogger("onnxps.security")

_READ = frozenset(
    {
        "DescribeGroup",
        "ListGroups",
        "Pull",
        "PullStream",
        "PullRows",
        "ListRows",
        "Apply",
        "ApplyStream",
        "SharedMemoryHello",
        "DataChannelHello",
        "History",
    }
)
# Workers join, heartbeat and leave the groups they push to: that is writing.
_WRITE = _READ | {
    "Push",
    "PushStream",
    "PushPullStream",
    "PushRows",
    "SetLearningRate",
    "JoinGroup",
    "Heartbeat",
    "LeaveGroup",
}
_ADMIN = _WRITE | {
    "CreateGroup",
    "CreateGroupStream",
    "DeleteGroup",
    "Save",
    "Rewind",
    "Fork",
    # resharding (docs/resharding.md): a group's move between shards
    "MoveGroup",
    "ExportGroup",
    "ImportGroup",
}
# A standby of a replicated shard follows its primary's log: the whole state of the
# shard, every tenant's groups. Only a replica may: a token of its own role that does
# nothing else, never an admin's (an admin may be confined to one tenant's prefix).
_REPLICATION = frozenset({"Replicate"})
ROLES: dict[str, frozenset[str]] = {
    "read": _READ,
    "write": _WRITE,
    "admin": _ADMIN,
    "replication": _REPLICATION,
}
# Resharding moves a group between shards: the cluster's operation, not a tenant's.
# ImportGroup names its group only inside the snapshot it streams, and a move's
# steps fence, hold and delete groups: only an admin for every group (prefix '*')
# may call them, never one confined to a prefix (it could race an operator's move
# with a forged snapshot of another tenant's group).
_WHOLE_CLUSTER = frozenset({"MoveGroup", "ExportGroup", "ImportGroup"})
# Methods that name no group: any prefix may call them (if the role allows).
_GROUPLESS = frozenset(
    {
        "ListGroups",
        "Apply",
        "ApplyStream",
        "Save",
        "Replicate",
        "ImportGroup",
        "SharedMemoryHello",
        "DataChannelHello",
    }
)


class ConfigError(ValueError):
    """A security setting that the server refuses to start with."""


# -- bind policy ---------------------------------------------------------------------
def _host(address: str) -> str:
    if address.startswith("[") and "]" in address:
        return address[1 : address.index("]")]
    return address.rsplit(":", 1)[0] if ":" in address else address


def is_loopback(address: str) -> bool:
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = _host(address).strip()
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_bind_policy(config: Any) -> None:
    """Refuse a non-loopback bind without TLS and tokens unless ``config.insecure``."""
    if config.tls_key and not config.tls_cert or config.tls_cert and not config.tls_key:
        raise ConfigError(
            "TLS needs both a certificate (--tls-cert) and a key (--tls-key)"
        )
    if config.tls_client_ca and not config.tls_cert:
        raise ConfigError(
            "mutual TLS (--tls-client-ca) needs server TLS too: pass --tls-cert and "
            "--tls-key"
        )
    if getattr(config, "tls_ca", None) and not config.tls_cert:
        raise ConfigError(
            "--tls-ca is the CA a standby checks its primary's certificate against: "
            "a replica set's servers serve TLS, so pass --tls-cert and --tls-key too"
        )
    if is_loopback(config.address):
        return
    missing = [
        what
        for what, ok in (
            ("TLS (--tls-cert, --tls-key)", config.tls_cert and config.tls_key),
            ("token authentication (--tokens-file)", config.tokens_file),
        )
        if not ok
    ]
    if not missing:
        return
    if config.insecure:
        log.warning(
            "listening on %s, which is not loopback, without %s: anyone who can reach "
            "this address can read and change every group (--insecure)",
            config.address,
            " and ".join(missing),
        )
        return
    raise ConfigError(
        f"refusing to listen on {config.address}, which is not a loopback address, "
        f"without {' and '.join(missing)}: anyone who can reach it could read and "
        "change every group. Configure both, listen on 127.0.0.1, or pass --insecure "
        "(ONNXPS_INSECURE=1) to accept the risk."
    )


def check_advertise_address(config: Any) -> None:
    """A replica set member writes where it is reached to etcd (``--coordinator``):
    a host:port another host can dial, never a wildcard such as 0.0.0.0. Its
    default is the bound ``--address``."""
    advertised = config.advertise_address
    if advertised is None:
        if config.coordinator and _wildcard(config.address):
            raise ConfigError(
                f"--address {config.address} is a wildcard: a replica set member "
                "writes where it is reached to etcd, and no client or standby can "
                "dial that; give --advertise-address HOST:PORT (e.g. the pod's DNS "
                "name)"
            )
        return
    if not config.coordinator:
        raise ConfigError(
            "--advertise-address is what a replica set member writes to etcd: it "
            "needs --coordinator"
        )
    host, _, port = advertised.rpartition(":")
    if (
        _wildcard(advertised)
        or not host
        or not port.isdigit()
        or not 0 < int(port) < 65536
        or ":" in host
        and not host.startswith("[")
    ):
        raise ConfigError(
            "--advertise-address must be HOST:PORT that another host can dial (e.g. "
            f"onnxps-0.onnxps-headless:50051), got {advertised!r}"
        )


def _wildcard(address: str) -> bool:
    if address.startswith(("unix:", "unix-abstract:")):
        return False
    return _host(address).strip() in ("", "0.0.0.0", "::")


# -- TLS -----------------------------------------------------------------------------
def server_credentials(config: Any) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None
    cert = Path(config.tls_cert).read_bytes()
    key = Path(config.tls_key).read_bytes()
    ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


# -- tokens --------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenGrant:
    """What one token may do. The token itself is kept only as its SHA-256 digest."""

    digest: bytes
    role: str
    prefixes: tuple[str, ...]  # "" matches every group
    label: str  # "entry N" for logs; never the token

    def allows_group(self, group: str) -> bool:
        return any(group.startswith(p) for p in self.prefixes)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _grant(token: Any, role: Any, prefixes: Any, where: str) -> TokenGrant:
    if not isinstance(token, str) or not token.strip() or token != token.strip():
        raise ConfigError(f"{where}: the token must be a non-empty string")
    if role not in ROLES:
        raise ConfigError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    if isinstance(prefixes, str):
        prefixes = [prefixes]
    if not isinstance(prefixes, list) or not prefixes:
        raise ConfigError(f"{where}: give at least one group prefix ('*' for all)")
    if not all(isinstance(p, str) for p in prefixes):
        raise ConfigError(f"{where}: group prefixes must be strings")
    clean = tuple("" if p == "*" else p for p in prefixes)
    if role == "replication" and clean != ("",):
        raise ConfigError(
            f"{where}: a replication token follows the whole shard (every group): "
            "give it the prefix '*'"
        )
    return TokenGrant(_digest(token), role, clean, where)


def parse_tokens(text: str) -> list[TokenGrant]:
    """Grants from a tokens file: JSON, or ``token role prefix[,prefix...]`` lines."""
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"tokens file is not valid JSON (line {exc.lineno})"
            ) from None
        entries = data.get("tokens") if isinstance(data, dict) else data
        if not isinstance(entries, list):
            raise ConfigError('a JSON tokens file is {"tokens": [...]} or a list')
        grants = []
        for i, e in enumerate(entries):
            where = f"tokens entry {i + 1}"
            if not isinstance(e, dict):
                raise ConfigError(f"{where}: expected an object")
            grants.append(
                _grant(e.get("token"), e.get("role"), e.get("prefixes", ["*"]), where)
            )
    else:
        grants = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            where = f"tokens file line {n}"
            if len(parts) != 3:
                raise ConfigError(
                    f"{where}: expected 'token role prefix[,prefix...]', got "
                    f"{len(parts)} fields"
                )
            grants.append(_grant(parts[0], parts[1], parts[2].split(","), where))
    digests = [g.digest for g in grants]
    if len(set(digests)) != len(digests):
        raise ConfigError("the tokens file lists one token twice")
    return grants


def load_tokens(path: str) -> list[TokenGrant]:
    grants = parse_tokens(Path(path).read_text(encoding="utf-8"))
    log.info("loaded %d tokens from %s", len(grants), path)
    return grants


def _bearer(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = str(value).partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class _Refused(Refusal):
    """Aborts the call; nothing is read from it (see ``Refusal``)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        reason: str,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.code, self.details = code, details
        self.reason, self.metadata = reason, metadata

    def before(self, call: Call, request: Any, context: grpc.ServicerContext) -> Any:
        refuse(context, self.code, self.details, self.reason, self.metadata)


class _GroupChecked(CallHooks):
    """Refuses a group outside the token's prefixes. A stream's group is checked
    when its header is read further in (after the stream limit counted it)."""

    def __init__(self, grant: TokenGrant, req_s: bool) -> None:
        self.grant, self.req_s = grant, req_s

    def before(self, call: Call, request: Any, context: grpc.ServicerContext) -> Any:
        def check(msg: Any) -> None:
            group = group_of(msg)
            # No group (an undecodable or header-less request) is refused further in.
            if group is not None and not self.grant.allows_group(group):
                _deny(context, self.grant, group)
            # a fork creates a group: the token must be allowed that one too
            made = getattr(msg, "new_group", None)
            if isinstance(made, str) and not self.grant.allows_group(made):
                _deny(context, self.grant, made)

        if self.req_s:
            return on_first(request, check)
        check(request)
        return request


class _ListFiltered(CallHooks):
    """Keeps only the groups the token may see in a ListGroups reply."""

    def __init__(self, grant: TokenGrant) -> None:
        self.grant = grant

    def reply(self, call: Call, msg: Any) -> Any:
        if not isinstance(msg, pb.ListGroupsResponse):
            return msg
        return pb.ListGroupsResponse(
            groups=[g for g in msg.groups if self.grant.allows_group(g.name)]
        )


class TokenAuthInterceptor(HookInterceptor):
    """Bearer tokens -> role and group prefixes. Health and reflection stay open."""

    reads_metadata = True

    def __init__(self, grants: list[TokenGrant]) -> None:
        self._grants = list(grants)
        # a grant's hooks per method, made once: the chain keeps one plan for each
        self._granted: dict[tuple[str, bytes, bool], CallHooks | None] = {}

    def _lookup(self, token: str) -> TokenGrant | None:
        presented = _digest(token)
        found = None
        for grant in self._grants:  # no early exit: the same work for every token
            if hmac.compare_digest(presented, grant.digest):
                found = grant
        return found

    def call_hooks(
        self, handler: Handler, called: tuple[str, str], metadata: Any
    ) -> CallHooks | None:
        service, method = called
        if service != SERVICE:
            return None
        token = _bearer(metadata)
        grant = self._lookup(token) if token is not None else None
        # Decided from the metadata alone: nothing is read from the call first.
        if grant is None:
            return _Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs a known token: send 'authorization: Bearer <token>'"
                if token is None
                else f"{method}: the token is not known to this server",
                "TOKEN_MISSING" if token is None else "TOKEN_UNKNOWN",
                {"method": method},
            )
        if method not in ROLES[grant.role]:
            return _Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"a {grant.role} token may not call {method}",
                "ROLE_FORBIDS_METHOD",
                {"method": method, "role": grant.role},
            )
        if method in _WHOLE_CLUSTER and "" not in grant.prefixes:
            allowed = ", ".join(repr(p) for p in grant.prefixes)
            return _Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} moves groups between shards (onnxps reshard): it "
                "needs an admin token for every group (prefix '*'); this one "
                f"may touch groups starting with {allowed} only",
                "GROUP_NOT_PERMITTED",
                {"method": method, "prefixes": allowed},
            )
        req_s = bool(handler.request_streaming)
        key = (method, grant.digest, req_s)
        if key not in self._granted:
            self._granted[key] = _granted(grant, method, req_s)
        return self._granted[key]


def _granted(grant: TokenGrant, method: str, req_s: bool) -> CallHooks | None:
    """What a token allowed to call ``method`` checks around each call of it."""
    if method == "ListGroups":
        return _ListFiltered(grant)
    if method in _GROUPLESS:
        return None
    return _GroupChecked(grant, req_s)


def _deny(context: grpc.ServicerContext, grant: TokenGrant, group: str) -> None:
    allowed = ", ".join(repr(p) for p in grant.prefixes)
    refuse(
        context,
        grpc.StatusCode.PERMISSION_DENIED,
        f"this token may touch groups whose names start with {allowed}, not {group!r}",
        "GROUP_NOT_PERMITTED",
        {"group": group, "prefixes": allowed},
    )
