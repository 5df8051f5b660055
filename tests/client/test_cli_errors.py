"""Every ``onnxps`` command meets a mistake with one line on stderr and exit status
1 (it ran and failed) or 2 (wrong flags or configuration), never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _procs import clean_env
from onnxps import cli
from onnxps.client import Adagrad, Adam, Client, ExportFileError
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.interceptors.security import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], status: int) -> str:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # a usage mistake found by the parser
        code = exit_.code  # type: ignore[assignment]
    assert code == status
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def _groups(client: Client) -> dict[str, int]:
    return {g.name: g.update_count for g in client.list_groups()}


# -- export / import -------------------------------------------------------------------


@pytest.fixture
def exported(
    server: ServerHandle,
    client: Client,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> Path:
    for i, name in enumerate(("a1", "a2", "a3")):
        client.create_group(
            name, Adam(), learning_rate=0.01, tensors={"w": np.full(3, i, np.float32)}
        )
    client.push("a2", np.ones(3, np.float32))
    path = tmp_path / "groups.npz"
    assert cli.main(["export", server.address, str(path)]) == 0
    assert capsys.readouterr().out == f"exported 3 groups to {path}\n"
    return path


def test_export_and_import_print_counts(
    servers: Callable[..., ServerHandle],
    exported: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    other = servers()
    assert cli.main(["import", other.address, str(exported)]) == 0
    assert capsys.readouterr().out == (
        f"imported 3 groups from {exported} (created a1, a2, a3)\n"
    )
    with Client(other.address) as c:
        assert _groups(c) == {"a1": 0, "a2": 1, "a3": 0}
        c.delete_group("a1")
        c.delete_group("a3")
    path = exported.parent / "one.npz"
    assert cli.main(["export", other.address, str(path)]) == 0
    assert capsys.readouterr().out == f"exported 1 group to {path}\n"


def test_import_refuses_existing_groups_before_creating_any(
    server: ServerHandle,
    client: Client,
    exported: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    client.delete_group("a1")
    client.delete_group("a3")
    capsys.readouterr()
    line = _one_line(capsys, ["import", server.address, str(exported)], 1)
    assert line == (
        f"onnxps import: the server already has 1 group of {exported}: a2; nothing "
        "was imported (--skip-existing keeps the server's, --replace deletes them "
        "and imports the file's)"
    )
    with pytest.raises(ExportFileError) as err:
        client.import_(exported)
    assert err.value.existing == ["a2"]
    assert str(err.value).endswith(
        'nothing was imported (existing="skip" keeps the server\'s, '
        'existing="replace" deletes them and imports the file\'s)'
    )
    assert _groups(client) == {"a2": 1}  # a1 and a3 were not created


def test_import_skip_existing(
    server: ServerHandle,
    client: Client,
    exported: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    client.delete_group("a1")
    client.push("a2", np.ones(3, np.float32))  # T=2 on the server, 1 in the file
    capsys.readouterr()
    argv = ["import", server.address, str(exported), "--skip-existing"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == (
        f"imported 1 group from {exported} (created a1; skipped 2 existing groups: "
        "a2, a3)\n"
    )
    assert _groups(client) == {"a1": 0, "a2": 2, "a3": 0}


def test_import_replace(
    server: ServerHandle,
    client: Client,
    exported: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    client.delete_group("a1")
    client.push("a2", np.ones(3, np.float32))
    capsys.readouterr()
    argv = ["import", server.address, str(exported), "--replace"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == (
        f"imported 3 groups from {exported} (created a1; replaced a2, a3)\n"
    )
    assert _groups(client) == {"a1": 0, "a2": 1, "a3": 0}
    with pytest.raises(SystemExit) as exit_:
        cli.main(
            ["import", server.address, str(exported), "--replace", "--skip-existing"]
        )
    assert exit_.value.code == 2


def test_import_of_a_missing_file_or_not_an_npz(
    server: ServerHandle, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.npz"
    line = _one_line(capsys, ["import", server.address, str(missing)], 1)
    assert line == f"onnxps import: cannot read {missing}: No such file or directory"
    text = tmp_path / "notes.npz"
    text.write_text("hello, not an archive\n")
    line = _one_line(capsys, ["import", server.address, str(text)], 1)
    assert line.startswith(f"onnxps import: {text} is not an onnxps export file (")
    plain = tmp_path / "plain.npz"
    np.savez(plain, x=np.zeros(3))
    line = _one_line(capsys, ["import", server.address, str(plain)], 1)
    assert line == f"onnxps import: {plain} is not an onnxps export file (no metadata)"


def test_export_and_import_with_the_server_down(
    tmp_path: Path, exported: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    down = f"127.0.0.1:{_free_port()}"
    capsys.readouterr()
    for argv in (
        ["export", down, str(tmp_path / "x.npz"), "--timeout", "1"],
        ["import", down, str(exported), "--timeout", "1"],
    ):
        line = _one_line(capsys, argv, 1)
        assert line.startswith(f"onnxps {argv[0]}: {down}: ")
        assert "UNAVAILABLE" in line or "DEADLINE_EXCEEDED" in line
    assert not (tmp_path / "x.npz").exists()


def test_export_to_a_directory_that_does_not_exist(
    server: ServerHandle, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "no" / "such" / "x.npz"
    line = _one_line(capsys, ["export", server.address, str(path)], 1)
    assert line.startswith(f"onnxps export: cannot write {path}: ")


@pytest.mark.parametrize("command", ["export", "import", "status"])
def test_client_commands_share_the_connection_flags(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [command, "127.0.0.1:1"] + (
        [str(tmp_path / "f.npz")] if command != "status" else []
    )
    missing = tmp_path / "ca.pem"
    line = _one_line(
        capsys, [*argv, "--tls-ca", str(missing), "--token", "t", "--timeout", "2"], 2
    )
    assert line == (
        f"onnxps {command}: cannot read the TLS CA file {missing}: No such file or "
        "directory"
    )
    line = _one_line(capsys, [*argv, "--timeout", "0"], 2)
    assert line.startswith(
        f"onnxps {command}: argument --timeout: must be a finite number > 0, got 0"
    )


# -- serve -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--threads", "0"], "threads must be >= 1, got 0"),
        (["--address", "127.0.0.1:99999"], "the port must be 1..65535"),
        (["--address", "127.0.0.1"], "address must be host:port"),
        (["--chunk-bytes", "0"], "chunk_bytes must be >= 1, got 0"),
        (["--chunk-bytes", "-5"], "chunk_bytes must be >= 1, got -5"),
        (["--snapshot-interval", "-1"], "snapshot_interval must be a finite number"),
        (["--max-message-bytes", "10"], "max_message_bytes must hold a stream chunk"),
        (["--lease-seconds", "0"], "lease_seconds must be a finite number > 0"),
        (["--lease-seconds", "inf"], "lease_seconds must be a finite number > 0"),
        (["--keep-snapshots", "0"], "keep_snapshots must be >= 1"),
        (["--max-groups", "-1"], "max_groups must be >= 0"),
        (["--metrics-port", "70000"], "metrics_port must be 1..65535"),
        (["--log-level", "LOUD"], "argument --log-level: 'LOUD' is not one of"),
        (["--threads", "many"], "argument --threads: 'many' is not a valid int"),
        (
            ["--max-message-bytes", "10XB"],
            "argument --max-message-bytes: '10XB' is not a byte count "
            "(e.g. 1048576, 256MiB, 4GiB)",
        ),
        (
            ["--port", "5"],
            "onnxps serve: unrecognized arguments: --port 5 "
            "(--port: use --address HOST:PORT) (see onnxps serve --help)",
        ),
        (
            ["--adress", "127.0.0.1:0"],
            "(--adress: did you mean --address?) (see onnxps serve --help)",
        ),
    ],
)
def test_serve_refuses_bad_flags_with_one_line_and_status_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_line(capsys, ["serve", "--durability", "none", *flags], 2)
    assert line.startswith(("onnxps: ", "onnxps serve: ")) and message in line


def test_serve_help_states_each_default_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    member = out[out.index("--member-id MEMBER_ID") : out.index("--replication-token")]
    assert member.count("host name and port") == 1, member
    assert member.endswith("(ONNXPS_MEMBER_ID; default host name and port) ")


def test_server_config_validates_itself() -> None:
    with pytest.raises(ConfigError, match="lease_seconds must be a finite number"):
        ServerConfig(lease_seconds=float("nan"))
    assert ServerConfig(address="unix:/tmp/onnxps.sock").address.startswith("unix:")
    assert ServerConfig(address="[::1]:0").address == "[::1]:0"


def test_serve_with_missing_tls_or_tokens_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "absent.pem"
    base = ["serve", "--address", "127.0.0.1:0", "--durability", "none"]
    line = _one_line(capsys, [*base, "--tokens-file", str(missing)], 2)
    assert line == f"onnxps: cannot read {missing}: No such file or directory"
    flags = ["--tls-cert", str(missing), "--tls-key", str(missing)]
    line = _one_line(capsys, [*base, *flags], 2)
    assert line == f"onnxps: cannot read {missing}: No such file or directory"


def test_serve_when_ports_or_the_data_dir_are_in_use(
    server: ServerHandle,
    servers: Callable[..., ServerHandle],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _one_line(
        capsys, ["serve", "--address", server.address, "--durability", "none"], 1
    )
    assert line == (
        f"onnxps: cannot listen on {server.address}: the port is in use (is another "
        "server running? pass another --address)"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--address", "127.0.0.1:0", "--durability", "none"]
        line = _one_line(capsys, [*argv, "--metrics-port", str(port)], 1)
    assert line.startswith(f"onnxps: cannot serve metrics on port {port}: ")
    data = tmp_path / "data"
    config = ServerConfig(address="127.0.0.1:0", data_dir=str(data))
    servers(config)
    argv = ["serve", "--address", "127.0.0.1:0", "--data-dir", str(data)]
    line = _one_line(capsys, argv, 1)
    assert line.startswith(f"onnxps: data directory {str(data)!r} is in use by another")


def test_serve_bad_variable_names_it(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(ONNXPS_THREADS="zero", ONNXPS_DURABILITY="none"),
    )
    assert run.returncode == 2
    assert run.stderr == (
        "onnxps serve: argument --threads: 'zero' is not a valid int (from "
        "ONNXPS_THREADS) (see onnxps serve --help)\n"
    )


def test_a_bad_serve_variable_does_not_break_other_commands(
    server: ServerHandle,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("ONNXPS_THREADS", "zero")
    assert cli.main(["status", server.address]) == 0
    assert capsys.readouterr().out == f"no groups on {server.address}\n"


# -- the command itself ----------------------------------------------------------------


def test_version_and_python_dash_m(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == "onnxps 0.1.0\n"
    for module in ("onnxps", "onnxps.cli"):
        run = subprocess.run(
            [sys.executable, "-m", module, "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
        assert (run.returncode, run.stdout, run.stderr) == (0, "onnxps 0.1.0\n", "")


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["status", "--help"]])
def test_the_command_loads_only_what_it_runs(argv: list[str]) -> None:
    """``onnxps --version`` and ``--help`` load neither the server nor the client
    (grpc, numpy: seconds on a loaded machine); ``status`` the client, not the
    server."""
    probe = (
        "import sys\n"
        "from onnxps.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('onnxps.server', 'onnxps.client', 'grpc', 'numpy')\n"
        "print('LOADED', *sorted(m for m in heavy if m in sys.modules))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert run.returncode == 0, run.stderr
    loaded = run.stdout.splitlines()[-1].split()[1:]
    if argv[0] == "status":
        assert loaded == ["grpc", "numpy", "onnxps.client"]
    else:
        assert loaded == []


def test_an_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("onnxps: argument COMMAND: invalid choice: 'bogus'")
    assert len(err.splitlines()) == 1


def test_status_says_one_group(
    server: ServerHandle, client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    client.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(2)})
    assert cli.main(["status", server.address]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_a_client_command_run_in_process_leaves_grpc_verbosity_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a process where grpc is loaded (a program, or this test run, calling
    ``main``), GRPC_VERBOSITY would change nothing for the command and would reach
    the servers that process starts next, whose logs then lose a rejected peer's
    TLS error (CI: the rogue-certificate replication test)."""
    import os

    import grpc  # noqa: F401 - loaded, as in any program that calls main()
    from onnxps.cli._main import main

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert "GRPC_VERBOSITY" not in os.environ
