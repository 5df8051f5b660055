"""The parts of a split group never stay a push apart (issue 27, items 2-4).

Real shard processes on 127.0.0.1 (``--shard I/N``, WAL mode); a part is made to
fail in each way a live client can see (shard down while 4 threads share one
client, RESOURCE_EXHAUSTED "retry later", a shard restarted with the wrong index),
and every part must end at the same T with the X of one server given the same
pushes. A part restored from an older data dir is reported by the client
(``PartsDivergedError``) and by ``onnxps status``, and export/import repairs it.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
from _procs import start_server, stop
from onnxps.client import (
    Adam,
    AsyncClient,
    Client,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    PartsDivergedError,
    ResourceExhaustedError,
    UnavailableError,
)
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

SHAPES = ((50, 40), (40,), (3,))
SPLIT = 2000  # bytes: the group is split in 3 parts, one per shard
GRADS = [np.full(s, 0.25, np.float32) for s in SHAPES]  # every push the same: X
# depends on the number of pushes alone, whatever order each part took them in


@contextmanager
def cluster(tmp: Path, *extra: str) -> Iterator[tuple[list[str], list[Path], Shards]]:
    """3 WAL shards (``extra``'s ``{i}`` is the shard index)."""
    data = [tmp / f"data{i}" for i in range(3)]
    shards = Shards(tmp, data)
    try:
        addresses = [shards.start(i, *extra) for i in range(3)]
        yield addresses, data, shards
    finally:
        shards.stop_all()


class Shards:
    def __init__(self, tmp: Path, data: list[Path]) -> None:
        self.tmp = tmp
        self.data = data
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.addresses: dict[int, str] = {}
        self.starts = 0

    def start(self, i: int, *extra: str, index: int | None = None) -> str:
        """Shard ``i`` (on its port once it has one), as ``--shard index/3``."""
        self.starts += 1
        args = [
            "--shard",
            f"{i if index is None else index}/3",
            "--durability",
            "wal",
            "--data-dir",
            str(self.data[i]),
            *(a.replace("{i}", str(i)) for a in extra),
        ]
        if i in self.addresses:
            args += ["--address", self.addresses[i]]
        proc, address = start_server(self.tmp / f"s{i}-{self.starts}.log", *args)
        self.procs[i] = proc
        self.addresses[i] = address
        return address

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def terminate(self, i: int) -> None:
        self.procs[i].terminate()
        assert self.procs[i].wait(30) == 0

    def stop_all(self) -> None:
        for p in self.procs.values():
            stop(p)


def _tensors() -> list[tuple[str, np.ndarray]]:
    return [
        (f"x{i}", np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s))
        for i, s in enumerate(SHAPES)
    ]


def _create(ps: Client, name: str) -> None:
    ps.create_group(name, Adam(), learning_rate=0.05, tensors=_tensors())


def _counts(ps: Client, group: str) -> list[int]:
    return [p.update_count for p in ps.describe_group(group).parts]


# rows 0, 20 and 40 of x0: one in each part's rows
ROWS = {"x0": (np.array([0, 20, 40]), np.full((3, 40), 0.25, np.float32))}


def _push(ps: Client, kind: str = "push", timeout: float | None = None) -> int:
    """One push of GRADS (``kind`` "push"), or of ROWS ("push_rows"): the new T."""
    if kind == "push_rows":
        return ps.push_rows("g", ROWS, timeout=timeout).update_count
    return ps.push("g", *GRADS, timeout=timeout)


def _assert_like_one_server(
    tmp: Path, got: list[np.ndarray], pushes: int, kind: str = "push"
) -> None:
    """``got`` (X, V, H of the cluster's group) is one server's after ``pushes``."""
    proc, address = start_server(tmp / "ref.log")
    try:
        with Client(address) as ref:
            _create(ref, "g")
            for _ in range(pushes):
                _push(ref, kind)
            want = ref.pull("g", state=True)
    finally:
        stop(proc)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w, strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["push", "push_rows"])
def test_four_threads_sharing_a_client_while_a_shard_is_down(
    tmp_path: Path, kind: str
) -> None:
    """Each of 4 concurrent pushes (or row pushes) reaches parts 0 and 2 and misses
    the part on the stopped shard: each keeps its own pending part (one slot per
    group kept only the last), and the push after the restart finishes all four
    first."""
    with cluster(tmp_path) as (addresses, _, shards):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "g")
            assert _push(ps, kind) == 1
            down = ps.describe_group("g").parts[1].shard
            up = [p.shard for p in ps.describe_group("g").parts if p.shard != down]
            shards.kill(down)
            start = threading.Barrier(4)
            errors: list[BaseException] = []

            def push_once() -> None:
                start.wait(10)
                try:
                    _push(ps, kind, timeout=1.0)
                except (UnavailableError, DeadlineExceededError) as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=push_once) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert len(errors) == 4
            for i in up:  # parts 0 and 2 took all four
                with Client(addresses[i]) as one:
                    assert [g.update_count for g in one.list_groups("g#")] == [5]
            with pytest.raises((UnavailableError, DeadlineExceededError)):
                _push(ps, kind, timeout=0.5)  # pending first: nothing sent
            shards.start(down)
            assert _push(ps, kind) == 6
            assert _counts(ps, "g") == [6, 6, 6]
            version, got = ps.pull_versioned("g", state=True)
            assert version == 6
    _assert_like_one_server(tmp_path, got, 6, kind)


@pytest.mark.slow
def test_four_async_tasks_while_a_shard_is_down(tmp_path: Path) -> None:
    """``AsyncClient`` runs the same routing: 4 pushes gathered while a shard is
    down each keep their part, and all land once it is back."""

    async def scenario(addresses: list[str], shards: Shards) -> list[np.ndarray]:
        async with AsyncClient(addresses, timeout=30, split_bytes=SPLIT) as ps:
            await ps.create_group("g", Adam(), learning_rate=0.05, tensors=_tensors())
            assert await ps.push("g", *GRADS) == 1
            down = (await ps.describe_group("g")).parts[0].shard
            shards.kill(down)
            results = await asyncio.gather(
                *(ps.push("g", *GRADS, timeout=1.0) for _ in range(4)),
                return_exceptions=True,
            )
            assert all(
                isinstance(r, UnavailableError | DeadlineExceededError) for r in results
            ), results
            shards.start(down)
            assert await ps.push("g", *GRADS) == 6
            assert [p.update_count for p in (await ps.describe_group("g")).parts] == [
                6,
                6,
                6,
            ]
            return await ps.pull("g", state=True)

    with cluster(tmp_path) as (addresses, _, shards):
        got = asyncio.run(scenario(addresses, shards))
    _assert_like_one_server(tmp_path, got, 6)


@pytest.mark.slow
def test_a_refusal_that_can_never_pass_is_found_before_any_part(
    tmp_path: Path,
) -> None:
    """A NaN in the slice of one part only: the client refuses the push before
    sending any part (that part alone would refuse it while the others applied);
    a group that allows NaN takes it on every part."""
    with cluster(tmp_path) as (addresses, _, _shards):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "g")
            bad = [g.copy() for g in GRADS]
            bad[2][1] = np.nan  # the last tensor: the last part's alone
            with pytest.raises(InvalidArgumentError) as err:
                ps.push("g", *bad)
            assert err.value.reason == "NON_FINITE_GRADIENT"
            assert _counts(ps, "g") == [0, 0, 0]
            ps.create_group(
                "nan-ok", Adam(), learning_rate=0.05, tensors=_tensors(),
                allow_non_finite=True,
            )  # fmt: skip
            assert ps.push("nan-ok", *bad) == 1
            assert _counts(ps, "nan-ok") == [1, 1, 1]
            assert ps.pull_versioned("g")[0] == 0


@pytest.mark.slow
def test_push_background_pushes_all_land_after_a_shard_returns(
    tmp_path: Path,
) -> None:
    """``push_background`` runs pushes at once on one client: the same as threads."""
    with cluster(tmp_path) as (addresses, _, shards):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "g")
            down = ps.describe_group("g").parts[2].shard
            shards.kill(down)
            futures = [ps.push_background("g", *GRADS, timeout=1.0) for _ in range(3)]
            for f in futures:
                with pytest.raises((UnavailableError, DeadlineExceededError)):
                    f.result(30)
            shards.start(down)
            ps.push("g", *GRADS)
            counts = _counts(ps, "g")
            assert len(set(counts)) == 1, counts
            t, got = ps.pull_versioned("g", state=True)
            assert t == counts[0]
    _assert_like_one_server(tmp_path, got, t)


LIMIT = 200_000  # the busy shard's in-flight bytes
HOLD = (LIMIT - 1000 - 256) // 4  # floats of a push that leaves 1000 bytes free


def _stalled_stream(address: str, release: threading.Event) -> Iterator[None]:
    """A PushStream to group "hold" at ``address`` that sends its header and then
    waits (holding all but 1000 bytes of the shard's in-flight budget) until
    ``release``."""
    with Client(address) as one:
        w = np.zeros(HOLD, np.float32)
        one.create_group("hold", Adam(), learning_rate=0.1, tensors={"w": w})
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.ParameterServerServiceStub(channel)
    header = pb.PushStreamRequest(
        header=pb.PushRequest(
            group="hold",
            gradients=[pb.Tensor(name="w", dtype=pb.DATA_TYPE_FLOAT, dims=[HOLD])],
        )
    )

    def requests() -> Iterator[pb.PushStreamRequest]:
        yield header
        release.wait(60)

    call = stub.PushStream.future(requests(), timeout=60)
    probe = pb.ListGroupsRequest(prefix="p" * 4000)
    for _ in range(200):  # until the header is admitted
        try:
            stub.ListGroups(probe, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            break
        release.wait(0.05)
    else:
        raise AssertionError("the stalled stream never held the shard's bytes")
    try:
        yield
    finally:
        release.set()
        try:
            call.result(30)
        except grpc.RpcError:
            pass  # it ends without its chunks: refused, nothing applied
        channel.close()


@pytest.mark.slow
def test_a_part_refused_with_resource_exhausted_is_resent(tmp_path: Path) -> None:
    """One shard's in-flight bytes are held: its part refuses RESOURCE_EXHAUSTED
    ("retry later") while the others apply. The push fails once its deadline has
    passed, the part is kept, and the next push sends it first."""
    with cluster(tmp_path, "--max-inflight-bytes", str(LIMIT)) as (
        addresses,
        _,
        _shards,
    ):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "g")
            assert ps.push("g", *GRADS) == 1
            busy = ps.describe_group("g").parts[1].shard
            release = threading.Event()
            stalled = _stalled_stream(addresses[busy], release)
            next(stalled)
            # refused until the deadline; the last resend may be cut by it
            with pytest.raises((ResourceExhaustedError, DeadlineExceededError)) as err:
                ps.push("g", *GRADS, timeout=1.0)
            assert err.value.reason == "INFLIGHT_BYTES"
            assert _counts(ps, "g") == [2, 1, 2]
            with pytest.raises(StopIteration):
                next(stalled)  # released
            assert ps.push("g", *GRADS) == 3
            assert _counts(ps, "g") == [3, 3, 3]
            got = ps.pull("g", state=True)
    _assert_like_one_server(tmp_path, got, 3)


@pytest.mark.slow
def test_a_shard_restarted_with_the_wrong_index_then_fixed(tmp_path: Path) -> None:
    """A shard restarted as another index refuses its part (SHARD_LAYOUT_MISMATCH)
    after the others applied; once it runs with its own index again, the next push
    sends the part first and the parts agree."""
    with cluster(tmp_path) as (addresses, _, shards):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "g")
            assert ps.push("g", *GRADS) == 1
            wrong = ps.describe_group("g").parts[1].shard
            shards.terminate(wrong)
            shards.start(wrong, index=(wrong + 1) % 3)
            with pytest.raises(FailedPreconditionError) as err:
                ps.push("g", *GRADS, timeout=5)
            assert err.value.reason == "SHARD_LAYOUT_MISMATCH"
            # still the wrong index: the pending part is refused again, nothing sent
            with pytest.raises(FailedPreconditionError):
                ps.push("g", *GRADS, timeout=5)
            shards.terminate(wrong)
            shards.start(wrong)
            assert ps.push("g", *GRADS) == 3
            assert _counts(ps, "g") == [3, 3, 3]
            got = ps.pull("g", state=True)
    _assert_like_one_server(tmp_path, got, 3)


@pytest.mark.slow
def test_a_client_closed_with_a_push_pending_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that ends with a push not landed on every part (as one that dies)
    leaves the parts apart; closing says which push and which parts, and a pull by
    another client raises PartsDivergedError once the shard is back."""
    with cluster(tmp_path) as (addresses, _, shards):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "g")
            part = ps.describe_group("g").parts[1]
            shards.kill(part.shard)
            with pytest.raises((UnavailableError, DeadlineExceededError)) as err:
                ps.push("g", *GRADS, timeout=0.5)
            seq = ps._pending.of("g")[0].seq
            caplog.clear()
        closing = [r.getMessage() for r in caplog.records if "closing" in r.msg]
        assert len(closing) == 1
        assert closing[0].startswith(
            f"closing the client with push seq {seq} to g not landed on g#p1of3 "
            f"(shard {part.shard}: {err.value}): the other parts took it (or may "
            "have), and stay a push ahead"
        )
        shards.start(part.shard)
        with Client(addresses, timeout=3, split_bytes=SPLIT) as other:
            assert _counts(other, "g") == [1, 0, 1]
            with pytest.raises(PartsDivergedError) as apart:
                other.pull("g")
            assert apart.value.update_counts == [1, 0, 1]


@pytest.mark.slow
def test_a_part_restored_from_an_older_data_dir_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Parts at T [6, 6, 5]: pull_versioned raises PartsDivergedError naming the
    group and each part's T, the push says each part's T, ``onnxps status`` flags
    the group, and export, delete, import makes the parts agree again."""
    from onnxps import cli

    with cluster(tmp_path) as (addresses, data, shards):
        target = ",".join(addresses)
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "g")
            for _ in range(5):
                ps.push("g", *GRADS)
            old = ps.describe_group("g").parts[2].shard
            shards.terminate(old)
            backup = tmp_path / "backup"
            shutil.copytree(data[old], backup)
            shards.start(old)
            assert ps.push("g", *GRADS) == 6
            shards.terminate(old)
            shutil.rmtree(data[old])
            shutil.copytree(backup, data[old])
            shards.start(old)
            assert _counts(ps, "g") == [6, 6, 5]
            assert ps.describe_group("g").parts_apart
            with pytest.raises(PartsDivergedError) as err:
                ps.pull_versioned("g", timeout=5)
            assert err.value.reason == "PARTS_APART"
            assert err.value.group == "g"
            assert err.value.update_counts == [6, 6, 5]
            assert err.value.metadata == {"group": "g", "update_counts": "6,6,5"}
            assert "g#p2of3 on shard" in str(err.value) and "T=5" in str(err.value)
            result = ps.push_detailed("g", *GRADS)
            assert result.part_update_counts == (7, 7, 6)
            capsys.readouterr()
            assert cli.main(["status", target]) == 0
            out = capsys.readouterr().out
            assert (
                "parts apart: g: T 7, 7, 6 (a part lost pushes the others applied; "
                "see docs/cluster.md, 'When the parts of a split group disagree')"
            ) in out.splitlines()
            rows = [
                cells
                for cells in (line.split() for line in out.splitlines())
                if len(cells) > 1 and cells[1].startswith("g#p")
            ]
            assert [r[5:] for r in rows] == [
                ["7", "NO"],
                ["7", "NO"],
                ["6", "NO:", "1", "behind"],
            ]
            # the repair: export (parts as they are, T the lowest), delete, import
            export = tmp_path / "g.npz"
            ps.export(export, "g")
            assert ps.delete_group("g")
            ps.import_(export)
            assert _counts(ps, "g") == [6, 6, 6]
            assert ps.pull_versioned("g")[0] == 6
