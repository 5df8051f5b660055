"""Shared memory across tenants and uids (issue 27, item 1).

A real server process runs as root with tokens; the victim (this process, root,
token confined to ``b/``) keeps X of ``b/secret`` and its gradients in
``tensor_buffers``; the attacker is a real client process running as uid 65534
(nobody) with a token confined to ``a/``. It names the victim's segments (names are
not secret: anyone may list /dev/shm) in ``Push.gradients_region`` and
``Pull.reply_region``, as the issue's attack did. Every such call must be refused
with PERMISSION_DENIED ``SEGMENT_NOT_YOURS`` before anything is read, written or
stepped, and no message may carry a segment's generation or key.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _procs import StartServer, clean_env
from onnxps.client import Client, Momentum
from onnxps.client._errors import translate
from onnxps.client.shm import Segment
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.transports._peercred import peer_uid
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import header_tensor
from onnxps.wire.shm import KEY_AT, KEY_BYTES, SHM_DIR

pytestmark = [
    pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)"),
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="needs root: the server runs as root and the "
        "attacker as uid 65534 (nobody)",
    ),
]

ADMIN, VICTIM, ATTACKER = "tok-admin-0123456789", "tok-b-0123456789", "tok-a-012345"
NOBODY = 65534
N = 1 << 16  # 256 KiB of float32: above the 64 KiB shared-memory threshold
RNG = np.random.default_rng(27)
X0 = RNG.standard_normal(N).astype(np.float32)
G = RNG.standard_normal(N).astype(np.float32)
SGD = Momentum(alpha=0.0, beta=1.0)  # X - lr * G, with lr = 1: exact in float32


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()


@pytest.fixture
def server(server_processes: StartServer, tmp_path: Path) -> Iterator[str]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} admin *\n{VICTIM} write b/\n{ATTACKER} write a/\n")
    proc, address = server_processes(
        tmp_path / "server.log", "--tokens-file", str(tokens)
    )
    with Client(address, token=ADMIN, shared_memory="off") as admin:
        admin.create_group("b/secret", SGD, learning_rate=1.0, tensors={"w": X0})
        admin.create_group(
            "a/x", SGD, learning_rate=1.0, tensors={"w": np.zeros(N, np.float32)}
        )
    yield address


# The attacker: a real client process of another uid. Each step is one raw call;
# it prints one JSON object: per step, "ok" (and, for a push through its own
# group, the digest of the gradient the server read) or the status code, reason
# and message. A generation a message leaks is used by the next steps, as the
# issue's attacker did.
_ATTACKER = textwrap.dedent(
    """
    import hashlib, json, os, re, sys
    import grpc
    import numpy as np
    from onnxps.client._errors import translate
    from onnxps.wire.codec import header_tensor, tensor_to_array, write_tensor
    from onnxps.v1 import parameter_server_pb2 as pb
    from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

    spec = json.loads(sys.argv[1])
    # what grpc imports lazily, imported while this process may read the checkout
    # (a clone in a 0700 directory is not readable by the uid below)
    grpc.insecure_channel(spec["address"]).close()
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])
    n = spec["n"]
    out = {"uid": os.geteuid()}

    def inline(value):
        t = pb.Tensor()
        write_tensor(t, np.full(n, value, np.float32), "w")
        return t

    def x_of(stub, md, group):
        reply = stub.Pull(pb.PullRequest(group=group), timeout=10, metadata=md)
        return tensor_to_array(reply.tensors[0], "w").copy()

    with grpc.insecure_channel(spec["address"]) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        for step in spec["steps"]:
            md = [("authorization", "Bearer " + step["token"])]
            group, kind = step["group"], step["kind"]
            region = pb.SharedMemoryRegion(
                segment=step.get("segment", ""),
                generation=step.get("generation", out.get("leaked", 0)),
                offsets=[64],
                key=bytes.fromhex(step.get("key", "")),
            )
            result = {"ok": True}
            try:
                if kind == "read":  # the segment's bytes as this group's gradient
                    before = x_of(stub, md, group)
                    stub.Push(
                        pb.PushRequest(
                            group=group,
                            gradients=[header_tensor(np.zeros(n, np.float32))],
                            gradients_region=region,
                        ),
                        timeout=10, metadata=md,
                    )
                    learned = before - x_of(stub, md, group)
                    result["learned"] = hashlib.sha256(learned.tobytes()).hexdigest()
                elif kind == "hello":
                    stub.SharedMemoryHello(
                        pb.SharedMemoryHelloRequest(segment=region.segment),
                        timeout=10, metadata=md,
                    )
                elif kind == "push":  # an ordinary push, bytes inline
                    stub.Push(
                        pb.PushRequest(group=group, gradients=[inline(step["value"])]),
                        timeout=10, metadata=md,
                    )
                elif kind == "write":  # this group's X into the segment
                    stub.Pull(
                        pb.PullRequest(group=group, reply_region=region),
                        timeout=10, metadata=md,
                    )
                elif kind == "push_reply":  # a push whose X goes into the segment
                    stub.Push(
                        pb.PushRequest(
                            group=group, gradients=[inline(0.0)], return_values=True,
                            reply_region=region,
                        ),
                        timeout=10, metadata=md,
                    )
                else:
                    raise SystemExit("unknown step " + kind)
            except grpc.RpcError as err:
                details = err.details() or ""
                result = {
                    "code": err.code().name,
                    "reason": translate(err).reason,
                    "details": details,
                }
                leaked = re.search(r"at generation ([0-9]+)", details)
                if leaked:
                    out["leaked"] = int(leaked.group(1))
            out[step["name"]] = result
    print(json.dumps(out))
    """
)


def _attack(tmp_path: Path, address: str, steps: list[dict[str, Any]]) -> Any:
    """Run ``steps`` in a client process of uid 65534; what it saw."""
    script = tmp_path / "attacker.py"
    script.write_text(_ATTACKER)
    spec = {"address": address, "uid": NOBODY, "n": N, "steps": steps}
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["uid"] == NOBODY
    return out


def _x(address: str, group: str) -> tuple[int, np.ndarray]:
    """T and X of ``group``, as the admin pulls them over gRPC."""
    with Client(address, token=ADMIN, shared_memory="off") as c:
        t, (x,) = c.pull_versioned(group)
    return t, x


def _key(segment_name: str) -> bytes:
    """A segment's key, read from its file as root can (so could its owner)."""
    with open(os.path.join(SHM_DIR, segment_name), "rb") as f:
        return f.read(KEY_AT + KEY_BYTES)[KEY_AT:]


def _not_yours(result: dict[str, Any], *generations: int) -> str:
    """``result`` is PERMISSION_DENIED SEGMENT_NOT_YOURS and names none of
    ``generations``; its message."""
    assert (result.get("code"), result.get("reason")) == (
        "PERMISSION_DENIED",
        "SEGMENT_NOT_YOURS",
    ), result
    assert "learned" not in result
    for g in generations:
        assert f"generation {g}" not in result["details"], result
    return str(result["details"])


def _segment(bufs: Any) -> Segment:
    seg = bufs._segment
    assert isinstance(seg, Segment)
    return seg


def test_a_tenant_of_another_uid_cannot_read_or_write_anothers_segments(
    server: str, tmp_path: Path
) -> None:
    """The issue's attack: the attacker (uid 65534, token confined to a/) names the
    victim's segments holding b/secret's pulled X and its gradients, reads them
    through pushes to a/x, and writes a/x's X (1e30) into the victim's gradients."""
    with Client(server, token=VICTIM, shared_memory="on", timeout=30) as victim:
        with (
            victim.tensor_buffers("b/secret") as xs,
            victim.tensor_buffers("b/secret") as grads,
        ):
            assert xs.shared and grads.shared
            assert victim.pull("b/secret", out=xs)[0] is xs[0]
            np.copyto(grads[0], G)  # computed, not pushed yet
            x_seg, g_seg = _segment(xs), _segment(grads)
            for seg in (x_seg, g_seg):  # root's, 0600: nobody cannot read the key
                st = os.stat(seg.path)
                assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
            gens = [x_seg.generation, g_seg.generation]
            steps: list[dict[str, Any]] = [
                # a wrong generation first: its message used to tell the right one
                {"name": "probe", "kind": "read", "segment": x_seg.name},
                {"name": "read_x", "kind": "read", "segment": x_seg.name},
                {"name": "probe_grads", "kind": "read", "segment": g_seg.name},
                {"name": "read_grads", "kind": "read", "segment": g_seg.name},
                {"name": "hello", "kind": "hello", "segment": g_seg.name},
                {"name": "to_1e30", "kind": "push", "value": -1e30},
                {"name": "write_grads", "kind": "write", "segment": g_seg.name},
                {"name": "push_reply", "kind": "push_reply", "segment": g_seg.name},
            ]
            for step in steps:
                step.update(token=ATTACKER, group="a/x")
            out = _attack(tmp_path, server, steps)
            for name in ("probe", "read_x", "probe_grads", "read_grads", "hello"):
                _not_yours(out[name], *gens)
            assert out["to_1e30"] == {"ok": True}  # its own group: allowed
            message = _not_yours(out["write_grads"], *gens)
            _not_yours(out["push_reply"], *gens)
            assert "does not carry the key of segment" in message
            # nothing of the victim's changed; a/x only by the attacker's own push
            assert np.array_equal(xs[0], X0)
            assert np.array_equal(grads[0], G)
            assert _x(server, "b/secret")[0] == 0
            t_a, x_a = _x(server, "a/x")
            assert t_a == 1  # the refused push_reply was refused before its step
            assert np.all(x_a == np.float32(1e30))
            # the victim's next push and pull, through the same segments
            assert victim.push("b/secret", *grads) == 1
            t, (x,) = victim.pull_versioned("b/secret", out=xs)
            assert x is xs[0]
            np.testing.assert_array_equal(x, X0 - G)
    assert t == 1
    t_b, x_b = _x(server, "b/secret")
    assert t_b == 1
    np.testing.assert_array_equal(x_b, X0 - G)


def test_a_segment_is_bound_to_its_token_and_uid_even_for_key_holders(
    server: str, tmp_path: Path
) -> None:
    """Whoever has learned a key (the segment's uid can read it) still cannot use
    the segment with another token, nor from another uid with the right token;
    the victim's own calls, on another connection too, still work."""
    with Client(server, token=VICTIM, shared_memory="on", timeout=30) as victim:
        with victim.tensor_buffers("b/secret") as grads:
            np.copyto(grads[0], G)
            assert victim.push("b/secret", *grads) == 1  # binds the key to VICTIM
            seg = _segment(grads)
            key = _key(seg.name)
            assert key == seg.key
            region = seg.publish(grads.offsets)
            as_victim = {"token": VICTIM, "group": "b/secret", "kind": "read"}
            fresh = Segment(64 + G.nbytes, key=os.urandom(KEY_BYTES))  # never named
            try:
                fresh_region = fresh.write([G])
                out = _attack(
                    tmp_path,
                    server,
                    [
                        # the right token and key, from uid 65534
                        {
                            "name": "other_uid",
                            "segment": seg.name,
                            "generation": region.generation,
                            "key": key.hex(),
                            **as_victim,
                        },
                        # the same for a segment nobody named yet
                        {
                            "name": "first_from_other_uid",
                            "segment": fresh.name,
                            "generation": fresh_region.generation,
                            "key": fresh.key.hex(),
                            **as_victim,
                        },
                    ],
                )
                assert "comes from uid 65534" in _not_yours(out["other_uid"])
                why = _not_yours(out["first_from_other_uid"])
                assert "comes from uid 65534" in why
                assert "belongs to uid 0" in why
                # the same uid (root) with another token and the key: refused
                with grpc.insecure_channel(server) as ch:
                    stub = pb_grpc.ParameterServerServiceStub(ch)
                    err = _push_refused(stub, ATTACKER, "a/x", region)
                    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert translate(err).reason == "SEGMENT_NOT_YOURS"
                    assert "bound to the token" in (err.details() or "")
                    # the victim's token on a new connection: the same client
                    reply = stub.Push(
                        _push_request("b/secret", region),
                        timeout=10,
                        metadata=(("authorization", f"Bearer {VICTIM}"),),
                    )
                    assert reply.update_count == 2
                    # and the segment nobody could bind is still free for root
                    reply = stub.Push(
                        _push_request("b/secret", fresh_region),
                        timeout=10,
                        metadata=(("authorization", f"Bearer {VICTIM}"),),
                    )
                    assert reply.update_count == 3
            finally:
                fresh.close()
            # the victim's own client still uses its segment
            assert victim.push("b/secret", *grads) == 4
    t, x = _x(server, "b/secret")
    assert t == 4
    np.testing.assert_allclose(x, X0 - 4 * G, rtol=1e-5, atol=1e-5)


def _push_request(group: str, region: pb.SharedMemoryRegion) -> pb.PushRequest:
    return pb.PushRequest(
        group=group, gradients=[header_tensor(G)], gradients_region=region
    )


def _push_refused(
    stub: pb_grpc.ParameterServerServiceStub,
    token: str,
    group: str,
    region: pb.SharedMemoryRegion,
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(
            _push_request(group, region),
            timeout=10,
            metadata=(("authorization", f"Bearer {token}"),),
        )
    return err.value


def test_a_stale_region_is_refused_without_the_segments_generation(
    server: str,
) -> None:
    """STALE_SEGMENT says the region is stale, never the generation it should
    have named (that worked as a capability)."""
    seg = Segment(64 + G.nbytes)
    try:
        seg.generation = 7_654_320
        region = seg.write([G])
        assert region.generation == 7_654_321
        stale = pb.SharedMemoryRegion()
        stale.CopyFrom(region)
        stale.generation = 5
        with grpc.insecure_channel(server) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)
            err = _push_refused(stub, VICTIM, "b/secret", stale)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert translate(err).reason == "STALE_SEGMENT"
        details = err.details() or ""
        assert "is not at the generation the call names" in details
        assert "7654321" not in details
        assert seg.key.hex() not in details
    finally:
        seg.close()
    assert _x(server, "b/secret")[0] == 0


def test_over_a_unix_socket_the_key_and_the_token_are_checked(
    servers: Callable[..., ServerHandle],
    tmp_path: Path,
) -> None:
    """A Unix socket tells gRPC no uid: the socket file's mode decides who
    connects, and a segment still serves only its key and its token."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN} admin *\n{VICTIM} write b/\n{ATTACKER} write a/\n")
    address = f"unix://{tmp_path}/ps.sock"
    config = ServerConfig(address=address, durability="none", tokens_file=str(tokens))
    servers(config)
    with Client(address, token=ADMIN, shared_memory="off") as admin:
        admin.create_group("b/secret", SGD, learning_rate=1.0, tensors={"w": X0})
        admin.create_group("a/x", SGD, learning_rate=1.0, tensors={"w": X0})
    with Client(address, token=VICTIM, shared_memory="on", timeout=30) as victim:
        with victim.tensor_buffers("b/secret") as grads:
            np.copyto(grads[0], G)
            assert victim.push("b/secret", *grads) == 1
            seg = _segment(grads)
            region = seg.publish(grads.offsets)
            keyless = pb.SharedMemoryRegion()
            keyless.CopyFrom(region)
            keyless.ClearField("key")
            with grpc.insecure_channel(address) as ch:
                stub = pb_grpc.ParameterServerServiceStub(ch)
                for token, group, named in (
                    (VICTIM, "b/secret", keyless),
                    (ATTACKER, "a/x", region),
                ):
                    err = _push_refused(stub, token, group, named)
                    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert translate(err).reason == "SEGMENT_NOT_YOURS"
            assert victim.push("b/secret", *grads) == 2
    with Client(address, token=ADMIN, shared_memory="off") as admin:
        assert admin.describe_group("a/x").update_count == 0


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_the_uid_of_a_loopback_peer_is_the_one_linux_lists(family: int) -> None:
    """``peer_uid`` finds the caller's end of a real loopback connection (made by
    a process of uid 65534, so the answer is not just this process's uid)."""
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.socket(family) as listener:
        try:
            listener.bind((host, 0))
        except OSError:
            pytest.skip(f"no {host} on this host")
        listener.listen()
        port = listener.getsockname()[1]
        client = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import os, socket, sys; os.setgid(65534); os.setuid(65534); "
                f"s = socket.socket({int(family)}); s.connect(({host!r}, {port})); "
                "sys.stdin.read()",
            ],
            stdin=subprocess.PIPE,
        )
        try:
            listener.settimeout(30)
            conn, addr = listener.accept()
            with conn:
                kind = "ipv4" if family == socket.AF_INET else "ipv6"
                at = addr[0] if family == socket.AF_INET else f"[{addr[0]}]"
                assert peer_uid(f"{kind}:{at}:{addr[1]}") == NOBODY
        finally:
            assert client.stdin is not None
            client.stdin.close()
            client.wait(timeout=30)
    assert peer_uid("unix:/run/onnxps.sock") is None
    assert peer_uid("ipv4:192.0.2.1:5") is None  # not a connection of this host
