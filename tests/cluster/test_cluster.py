"""A cluster of shard processes on 127.0.0.1: placement, split groups, failures.

Every shard is ``onnxps serve --shard I/N`` in its own process; workers are
``tests/workers/cluster_worker.py`` processes. A split group is compared bit for bit
with the same pushes on one server.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _cluster import OPTIMIZERS, shards
from _procs import StartServer, clean_env, start_server, stop
from onnxps.client import (
    Adagrad,
    Adam,
    AlreadyExistsError,
    Async,
    Client,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    Momentum,
    NotFoundError,
    OptimizerSpec,
    SharedMemoryError,
    Sync,
    UnavailableError,
    placement,
    shard_ranking,
)
from onnxps.client._cluster import (
    join_arrays,
    layout_from_listing,
    part_arrays,
    plan_layout,
    shard_score,
)
from onnxps.server.interceptors.security import ConfigError
from onnxps.server.interceptors.shard import parse_shard

WORKER = Path(__file__).parents[1] / "workers" / "cluster_worker.py"
SHAPES = ((50, 40), (40,), (3,))
SPLIT = 2000  # bytes: every test group is split in 3 parts


def _values(seed: int, dtype: Any) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng([seed, 99])
    return [
        (f"x{i}", rng.standard_normal(s).astype(dtype)) for i, s in enumerate(SHAPES)
    ]


def _create(ps: Client, name: str, opt: OptimizerSpec, dtype: Any, sync: bool) -> None:
    ps.create_group(
        name,
        opt,
        learning_rate=0.05,
        tensors=_values(len(name), dtype),
        consistency=Sync(4) if sync else Async(),
    )


def _workers(
    target: str,
    groups: Sequence[str],
    steps: int,
    *,
    turns: bool = False,
    use_async: bool = False,
) -> list[subprocess.Popen[str]]:
    """4 worker processes (``Client``s, or ``AsyncClient``s with ``use_async``)."""
    cmd = [sys.executable, str(WORKER), target, ",".join(groups)]
    extra = ["--steps", str(steps), "--seed", "5", *(["--turns"] if turns else [])]
    extra += ["--async"] if use_async else []
    return [
        subprocess.Popen(
            [*cmd, str(w), "4", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        for w in range(4)
    ]


def _finish(procs: Sequence[subprocess.Popen[str]], timeout: float = 240) -> None:
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        assert out.splitlines()[-1] == "done"


def test_placement_is_rendezvous_on_sha256_as_documented() -> None:
    # docs/cluster.md's worked example, for clients in other languages.
    scores = [shard_score("mlp", i) for i in range(3)]
    assert scores == [0xB333C256EE92B296, 0x489042A378D6A666, 0x7F90AC20EEEDF5C4]
    assert shard_ranking("mlp", 3) == [0, 2, 1]
    for i, s in enumerate(scores):
        digest = hashlib.sha256(b"mlp" + i.to_bytes(4, "big")).digest()
        assert s == int.from_bytes(digest[:8], "big")
    assert shard_ranking("mlp", 3) == sorted(range(3), key=lambda i: -scores[i])
    assert placement("mlp", 3) == shard_ranking("mlp", 3)[0]
    # adding a shard moves only the groups the new shard wins
    names = [f"group-{i}" for i in range(2000)]
    moved = [n for n in names if placement(n, 4) != placement(n, 5)]
    assert all(placement(n, 5) == 4 for n in moved)
    assert 300 < len(moved) < 500  # about 1/5 of them


def test_layout_splits_by_flat_element_ranges_and_joins_back() -> None:
    arrays = [np.arange(np.prod(s), dtype=np.float32).reshape(s) for s in SHAPES]
    arrays.insert(1, np.zeros((0, 4), np.float32))  # an empty tensor travels too
    names = [f"t{i}" for i in range(len(arrays))]
    shapes = [a.shape for a in arrays]
    layout = plan_layout("g", names, shapes, 4, 3, SPLIT)
    assert [p.name for p in layout.parts] == ["g#p0of3", "g#p1of3", "g#p2of3"]
    assert [p.shard for p in layout.parts] == shard_ranking("g", 3)
    total = sum(a.size for a in arrays)
    # the cuts at 681 and 1362 fall inside t0 (50, 40): moved down to rows 17, 34
    assert [p.element_count for p in layout.parts] == [680, 680, total - 1360]
    assert layout.slot_names(layout.parts[0])[0] == "t0@r0-17@50,40"
    assert layout.slot_names(layout.parts[2])[1:] == [
        "t1@r0-0@0,4",
        "t2@0-40@40",
        "t3@0-3@3",
    ]
    pieces = [part_arrays(layout, p, arrays) for p in layout.parts]
    for got, want in zip(join_arrays(layout, pieces), arrays, strict=True):
        np.testing.assert_array_equal(got, want, strict=True)
    listing = [
        (
            p.shard,
            p.name,
            [(n, a.shape) for n, a in zip(layout.slot_names(p), pc, strict=True)],
        )
        for p, pc in zip(layout.parts, pieces, strict=True)
    ]
    assert layout_from_listing("g", listing[::-1]) == layout
    small = plan_layout("g", names, shapes, 4, 3, 1 << 20)
    assert not small.split and small.parts[0].shard == placement("g", 3)


def test_shard_identity_from_flag_or_hostname_ordinal() -> None:
    assert str(parse_shard("2/4")) == "2/4"
    assert str(parse_shard("auto/4", hostname="ps-3")) == "3/4"
    assert str(parse_shard("auto/3", hostname="onnxps-ps-0")) == "0/3"
    for bad in ("4/4", "x/2", "1", "1/0", "-1/3"):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad)
    with pytest.raises(ConfigError, match="does not end in -<ordinal>"):
        parse_shard("auto/3", hostname="laptop")


def test_groups_spread_and_a_client_with_another_layout_is_refused(
    tmp_path: Path,
) -> None:
    with shards(tmp_path, 3) as (addresses, _):
        with Client(addresses, timeout=30) as ps:
            names = [f"small-{i}" for i in range(12)]
            for n in names:
                ps.create_group(n, Adam(), learning_rate=0.1, tensors={"w": np.ones(4)})
            for n in names:
                (part,) = ps.describe_group(n).parts
                assert (part.name, part.shard) == (n, placement(n, 3))
            assert {placement(n, 3) for n in names} == {0, 1, 2}
            for i, address in enumerate(addresses):
                with Client(address) as one:  # no routing metadata: served
                    held = {g.name for g in one.list_groups()}
                assert held == {n for n in names if placement(n, 3) == i}
            with pytest.raises(AlreadyExistsError):
                ps.create_group(
                    names[0], Adam(), learning_rate=0.1, tensors={"w": np.ones(9)}
                )
        with Client(addresses[:2], timeout=10) as two:
            with pytest.raises(FailedPreconditionError) as err:
                two.pull("small-0")
        assert "this is shard 0 of 3; the client routed for 2 shards" in str(err.value)
        assert err.value.reason == "SHARD_LAYOUT_MISMATCH"
        assert err.value.metadata == {"routed": "0/2", "shard": "0/3"}
        with Client(addresses[::-1], timeout=10) as swapped:
            with pytest.raises(FailedPreconditionError, match="routed this call to"):
                swapped.list_groups()


def test_two_client_processes_agree_on_placement_and_layout(tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from onnxps.client._cluster import placement, plan_layout\n"
        "out = [placement(f'g{i}', n) for n in (1, 2, 3, 7) for i in range(300)]\n"
        "lay = plan_layout('big', ['a', 'b'], [(1000, 3), (77,)], 8, 5, 4096)\n"
        "out.append([[p.name, p.shard, [list(vars(s).values()) for s in p.slots]]"
        " for p in lay.parts])\n"
        "print(json.dumps(out))\n"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env=clean_env(PYTHONHASHSEED=str(seed)),
        ).stdout
        for seed in (1, 2)
    ]
    assert runs[0] == runs[1]
    mine = [placement(f"g{i}", n) for n in (1, 2, 3, 7) for i in range(300)]
    assert json.loads(runs[0])[:-1] == mine


@pytest.mark.slow
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_split_group_steps_bit_for_bit_like_one_server(
    tmp_path: Path, sync: bool
) -> None:
    """4 worker processes, every optimizer, float32 and float64, on 3 shards and on
    one server: the same T, X, V and H, bit for bit."""
    groups = {
        f"{opt}-{np.dtype(dt).name}": (spec, dt)
        for opt, spec in OPTIMIZERS.items()
        for dt in (np.float32, np.float64)
    }
    steps = 3 if sync else 2
    with shards(tmp_path, 3) as (addresses, _):
        one, one_address = start_server(tmp_path / "one.log")
        try:
            with (
                Client(addresses, timeout=60, split_bytes=SPLIT) as cluster,
                Client(one_address, timeout=60) as single,
            ):
                for name, (spec, dt) in groups.items():
                    _create(cluster, name, spec, dt, sync)
                    _create(single, name, spec, dt, sync)
                    assert len(cluster.describe_group(name).parts) == 3
                runs = _workers(",".join(addresses), list(groups), steps, turns=True)
                runs += _workers(one_address, list(groups), steps, turns=True)
                _finish(runs)
                for name in groups:
                    t, got = cluster.pull_versioned(name, state=True)
                    t1, want = single.pull_versioned(name, state=True)
                    parts = cluster.describe_group(name).parts
                    assert t == t1 == (steps if sync else 4 * steps), name
                    assert [p.update_count for p in parts] == [t] * 3
                    assert len(got) == len(want)
                    for g, w in zip(got, want, strict=True):
                        np.testing.assert_array_equal(g, w, strict=True)
        finally:
            stop(one)


@pytest.mark.slow
def test_operations_work_on_the_cluster_as_on_one_server(tmp_path: Path) -> None:
    with shards(tmp_path, 3) as (addresses, _):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            ps.create_group(
                "m",
                Adam(),
                learning_rate=0.1,
                tensors=_values(1, np.float32),
                consistency=Async(max_staleness=1),
            )
            info = ps.describe_group("m")
            assert [n for n, _ in info.tensors] == ["x0", "x1", "x2"]
            assert info.tensors[0][1] == (50, 40)
            assert info.element_count == 2043
            assert ps.set_learning_rate("m", 0.5).learning_rate == 0.5
            assert all(
                g.learning_rate == 0.5
                for a in addresses
                for g in Client(a).list_groups("m#")
            )
            grads = [np.ones(s, np.float32) for s in SHAPES]
            assert ps.push("m", *grads) == 1
            values = ps.push("m", *grads, base_version=1, return_values=True)
            assert [v.shape for v in values] == list(SHAPES)
            assert ps.pull_versioned("m", min_version=2)[0] == 2
            from onnxps.client import FailedPreconditionError as Stale

            with pytest.raises(Stale):  # T=2, base 0: staleness 2 > 1, on no part
                ps.push("m", *grads, base_version=0)
            assert [p.update_count for p in ps.describe_group("m").parts] == [2] * 3
            with pytest.raises(InvalidArgumentError, match="shape"):
                ps.push("m", grads[1], grads[0], grads[2])
            lease = ps.join("m", worker_id="w1")
            assert lease.live_workers == 1
            assert all(
                [w.worker_id for w in g.workers] == ["w1"]
                for a in addresses
                for g in Client(a).list_groups("m#")
            )
            assert ps.leave("m", worker_id="w1").live_workers == 0
            assert [g.name for g in ps.list_groups()] == ["m"]
            assert ps.delete_group("m") is True
            assert ps.list_groups() == []
            with pytest.raises(NotFoundError, match="any of the 3 shards"):
                ps.pull("m")
            assert ps.delete_group("m") is False


@pytest.mark.slow
def test_save_writes_a_snapshot_on_every_shard(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with shards(
        tmp_path, 3, "--durability", "snapshot", "--data-dir", f"{data}{{i}}"
    ) as (
        addresses,
        _,
    ):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            ps.create_group("s", Adam(), learning_rate=0.1, tensors=_values(2, "f4"))
            saved = ps.save()
    paths = saved.path.split(", ")
    assert len(paths) == 3 and saved.groups == 3
    assert all(p.startswith(f"{data}{i}") for i, p in enumerate(paths))


def _part_counts(ps: Client, group: str) -> list[int]:
    return [p.update_count for p in ps.describe_group(group).parts]


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["Client", "AsyncClient"])
def test_kill_9_of_a_shard_under_load_workers_ride_through(
    tmp_path: Path, workers: str
) -> None:
    """WAL mode; shard 1 is killed with SIGKILL while 4 workers push, and restarted
    on the same port and data dir: every push lands exactly once on every part
    (workers of either client: the routing and its resends are the same code)."""
    data = tmp_path / "data"
    # two split groups (a part on every shard), and small ones on shard 1 and not
    small = [f"k-small-{i}" for i in range(20)]
    on_1 = next(n for n in small if placement(n, 3) == 1)
    off_1 = next(n for n in small if placement(n, 3) != 1)
    groups = ["k-a", "k-b", on_1, off_1]
    steps = 60
    wal = ("--durability", "wal", "--data-dir", f"{data}{{i}}")
    with shards(tmp_path, 3, *wal) as (addresses, procs):
        with Client(addresses, timeout=60, split_bytes=SPLIT) as ps:
            for g in groups[:2]:
                _create(ps, g, Adam(), np.float32, False)  # split in 3
            for g in groups[2:]:
                ps.create_group(g, Adam(), learning_rate=0.1, tensors={"w": np.ones(8)})
            runs = _workers(
                ",".join(addresses), groups, steps, use_async=workers == "AsyncClient"
            )
            # kill when the workers are well into their pushes
            deadline = 60.0
            import time

            t0 = time.monotonic()
            while ps.describe_group("k-a").update_count < 40:
                assert time.monotonic() - t0 < deadline
                time.sleep(0.05)
            assert all(p.poll() is None for p in runs)  # still pushing
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            time.sleep(1.0)  # workers see the shard gone
            port_args = ["--address", addresses[1]]
            proc, address = start_server(
                tmp_path / "s1-again.log",
                "--shard",
                "1/3",
                *port_args,
                *(a.replace("{i}", "1") for a in wal),
            )
            procs[1] = proc
            assert address == addresses[1]
            _finish(runs)
            for g in groups:
                assert _part_counts(ps, g) == [4 * steps] * len(
                    ps.describe_group(g).parts
                ), g
        log = (tmp_path / "s1-again.log").read_text()
        assert "onnxps listening" in log


@pytest.mark.slow
def test_export_from_3_shards_import_into_2_and_continue_bit_exact(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    names: dict[str, OptimizerSpec] = {
        "e-adam": Adam(),
        "e-mom": Momentum(alpha=0.9, beta=0.5),
    }
    export = tmp_path / "cluster.npz"

    def push_some(ps: Client, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(3):
            for n in names:
                ps.push(n, *[rng.standard_normal(s).astype(np.float64) for s in SHAPES])

    with shards(tmp_path, 3, tag="a") as (three, _):
        with Client(three, timeout=30, split_bytes=SPLIT) as ps:
            for n, spec in names.items():
                _create(ps, n, spec, np.float64, False)
            ps.create_group(
                "e-small", Adam(), learning_rate=0.1, tensors={"w": np.ones(3)}
            )
            push_some(ps, 1)
            assert sorted(ps.export(export)) == ["e-adam", "e-mom", "e-small"]
    ref_server, one_address = server_processes(tmp_path / "ref.log")
    with Client(one_address, timeout=30) as ref:
        for n, spec in names.items():
            _create(ref, n, spec, np.float64, False)
        push_some(ref, 1)
        push_some(ref, 2)
        want = {n: ref.pull_versioned(n, state=True) for n in names}
    with shards(tmp_path, 2, tag="b") as (two, _):
        with Client(two, timeout=30, split_bytes=SPLIT * 2) as ps:
            assert sorted(ps.import_(export)) == ["e-adam", "e-mom", "e-small"]
            assert len(ps.describe_group("e-adam").parts) == 2
            push_some(ps, 2)
            for n in names:
                t, got = ps.pull_versioned(n, state=True)
                assert t == want[n][0] == 6
                for g, w in zip(got, want[n][1], strict=True):
                    np.testing.assert_array_equal(g, w, strict=True)
            assert ps.pull("e-small")[0].tolist() == [1.0, 1.0, 1.0]


def test_shard_env_auto_takes_the_ordinal_of_hostname(
    server_processes: StartServer, tmp_path: Path
) -> None:
    proc, address = server_processes(
        tmp_path / "auto.log", env=clean_env(ONNXPS_SHARD="auto/3", HOSTNAME="ps-2")
    )
    assert "this server is shard 2 of 3" in (tmp_path / "auto.log").read_text()
    with Client([address, address, address], timeout=10) as ps:
        with pytest.raises(FailedPreconditionError, match="this is shard 2 of 3"):
            ps.list_groups()
    assert os.environ.get("ONNXPS_SHARD") is None


@pytest.mark.slow
def test_status_export_import_commands_take_a_shard_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from onnxps import cli

    export = tmp_path / "all.npz"
    with shards(tmp_path, 3, tag="c") as (three, procs):
        with Client(three, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "big", Adam(), np.float32, False)
            ps.create_group(
                "tiny", Adam(), learning_rate=0.1, tensors={"w": np.ones(2)}
            )
            ps.push("big", *[np.ones(s, np.float32) for s in SHAPES])
        target = ",".join(three)
        capsys.readouterr()
        assert cli.main(["status", target]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].split()[:2] == ["GROUP", "OPTIMIZER"]
        assert [line.split()[0] for line in out[1:3]] == ["big", "tiny"]
        assert out[1].split()[4:6] == ["2043", "1"]  # elements, T of the whole
        parts = [line.split() for line in out if line.startswith("big ")][1:]
        assert [p[1] for p in parts] == [f"big#p{k}of3" for k in range(3)]
        assert [p[5] for p in parts] == ["1", "1", "1"]
        shard_lines = [line.split() for line in out[out.index("") + 1 :] if line][-3:]
        assert [s[:3] for s in shard_lines] == [
            [str(i), three[i], "serving"] for i in range(3)
        ]
        assert cli.main(["export", target, str(export)]) == 0
        stop(procs[2])
        assert cli.main(["status", target, "--timeout", "1"]) == 1
        status = capsys.readouterr().out
        assert re.search(rf"^2 +{three[2]} +unreachable +-$", status, re.M)
    with shards(tmp_path, 2, tag="d") as (two, _):
        assert cli.main(["import", ",".join(two), str(export)]) == 0
        with Client(two, timeout=30) as ps:
            assert [g.name for g in ps.list_groups()] == ["big", "tiny"]
            assert ps.describe_group("big").update_count == 1


@pytest.mark.slow
def test_a_push_that_missed_a_shard_is_completed_by_the_next(
    server_processes: StartServer, tmp_path: Path
) -> None:
    """Shard down longer than a push's deadline: the push fails, having reached the
    other parts; the client's next push to the group sends the missing part first
    (same seq), so every part ends at the same T and the values of one server."""
    data = tmp_path / "data"
    wal = ("--durability", "wal", "--data-dir", f"{data}{{i}}")
    rng = np.random.default_rng(3)
    grads = [
        [rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(3)
    ]
    with shards(tmp_path, 3, *wal) as (addresses, procs):
        with Client(addresses, timeout=30, split_bytes=SPLIT) as ps:
            _create(ps, "late", Adam(), np.float32, False)
            assert ps.push("late", *grads[0]) == 1
            down = ps.describe_group("late").parts[1].shard
            procs[down].send_signal(signal.SIGKILL)
            procs[down].wait()
            with pytest.raises((DeadlineExceededError, UnavailableError)):
                ps.push("late", *grads[1], timeout=1.5)
            up = [p for p in range(3) if p != down]
            for i in up:
                with Client(addresses[i]) as one:
                    assert [g.update_count for g in one.list_groups("late#")] == [2]
            proc, _ = start_server(
                tmp_path / "again.log",
                "--shard",
                f"{down}/3",
                "--address",
                addresses[down],
                *(a.replace("{i}", str(down)) for a in wal),
            )
            procs[down] = proc
            assert ps.push("late", *grads[2]) == 3
            assert _part_counts(ps, "late") == [3, 3, 3]
            got = ps.pull("late", state=True)
    ref_server, one_address = server_processes(tmp_path / "ref.log")
    with Client(one_address) as ref:
        _create(ref, "late", Adam(), np.float32, False)
        for g in grads:
            ref.push("late", *g)
        want = ref.pull("late", state=True)
    for got_a, want_a in zip(got, want, strict=True):
        np.testing.assert_array_equal(got_a, want_a, strict=True)


def test_client_takes_a_list_of_shard_addresses_only() -> None:
    with pytest.raises(TypeError, match="a cluster's shards as a list of them"):
        Client(["127.0.0.1:1", ""])
    with Client(("127.0.0.1:1", "127.0.0.1:2")) as ps:
        assert (ps.shards, ps.address) == (2, "127.0.0.1:1,127.0.0.1:2")
    with Client("127.0.0.1:1") as one:
        assert one.shards is None


@pytest.mark.slow
def test_row_pushes_go_to_the_shard_holding_the_group(tmp_path: Path) -> None:
    table = np.zeros((100, 4), np.float32)
    rows = np.ones((2, 4), np.float32)
    with shards(tmp_path, 3) as (addresses, _):
        with Client(addresses, timeout=30) as ps:
            for name in ("emb-a", "emb-b", "emb-c", "emb-d"):
                ps.create_group(
                    name, Adagrad(), learning_rate=0.1, tensors={"e": table}
                )
                out = ps.push_rows(name, {"e": (np.array([3, 7]), rows)})
                assert (out.update_count, out.applied) == (1, True)
                got = ps.pull_rows(name, {"e": np.array([3, 5, 7])})["e"]
                (part,) = ps.describe_group(name).parts
                with Client(addresses[part.shard]) as one:  # where the group lives
                    full = one.pull(name)[0]
                np.testing.assert_array_equal(got, full[[3, 5, 7]])
                assert got[1].tolist() == [0.0] * 4 and got[0][0] < 0
        with Client(addresses, timeout=30, split_bytes=256) as split:
            split.create_group(
                "big", Adagrad(), learning_rate=0.1, tensors={"e": table}
            )
            assert len(split.describe_group("big").parts) == 3
            out = split.push_rows("big", {"e": (np.array([99, 0]), rows)})
            assert out.update_count == 1
            got = split.pull_rows("big", {"e": np.array([99, 50, 0])})["e"]
            np.testing.assert_array_equal(got, split.pull("big")[0][[99, 50, 0]])
            assert got[0][0] < 0 and got[1].tolist() == [0.0] * 4 and got[2][0] < 0


@pytest.mark.slow
def test_cluster_parts_travel_through_each_shards_shared_memory(
    tmp_path: Path,
) -> None:
    """A cluster client on the shards' host moves each part's bytes through shared
    memory with that shard (its own hello and segments): the same T and X as over
    gRPC, and with ``shared_memory="on"`` a shard that cannot share memory is an
    error naming it."""
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal(3000).astype(np.float32)
    grads = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
    with shards(tmp_path, 3) as (addresses, _):
        with (
            Client(addresses, split_bytes=SPLIT, shared_memory="on") as shm,
            Client(addresses, split_bytes=SPLIT, shared_memory="off") as plain,
        ):
            for c, name in ((shm, "via-shm"), (plain, "via-grpc")):
                c.create_group(name, Adam(), learning_rate=0.01, tensors={"x": x0})
                assert len(c.describe_group(name).parts) == 3
                for g in grads:
                    c.push(name, g)
            t, got = shm.pull_versioned("via-shm", state=True)
            t1, want = plain.pull_versioned("via-grpc", state=True)
            assert t == t1 == 3
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b, strict=True)
            assert sorted(shm._shm_links) == [0, 1, 2]  # one link (hello) a shard
    with shards(tmp_path, 2, "--shared-memory", "off", tag="off") as (addresses, _):
        with Client(addresses, split_bytes=SPLIT, shared_memory="on") as shm:
            with pytest.raises(SharedMemoryError, match=re.escape(addresses[0])):
                shm.create_group("g", Adam(), learning_rate=0.01, tensors={"x": x0})
                shm.push("g", grads[0])
