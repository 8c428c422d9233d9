"""What a sandboxed run is given, decided without starting one: the bwrap command line, its
mounts and their order, the environment pointed at the relay, the settings' validation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from harnessrl.services.controller.config import ControllerSection, SandboxSettings
from harnessrl.services.controller.local import local_runner
from harnessrl.services.controller.sandbox_plan import (
    GatewayAddress,
    Mount,
    bwrap_argv,
    command_paths,
    file_mounts,
    sandbox_env,
)


def _option_values(argv: list[str], option: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == option]


def test_the_argv_isolates_every_namespace_and_ends_with_the_init() -> None:
    mounts = [Mount("ro-bind", "/usr", "/usr"), Mount("tmpfs", "/tmp", size=4096, perms="1777")]
    init = ["/py", "-I", "/run/harnessrl/init.py", "{}"]
    for privileged in (True, False):
        argv = bwrap_argv(
            "bwrap", mounts, privileged=privileged, cwd=Path("/w/r"), info_fd=7, command=init
        )
        assert argv[0] == "bwrap"
        for flag in ("--die-with-parent", "--new-session", "--as-pid-1", "--unshare-pid"):
            assert flag in argv
        for flag in ("--unshare-ipc", "--unshare-uts", "--unshare-net"):
            assert flag in argv
        assert "--share-net" not in argv
        assert _option_values(argv, "--info-fd") == ["7"]
        assert ("--unshare-user" in argv) is not privileged
        assert ("--disable-userns" in argv) is not privileged
        tail = argv[argv.index("--remount-ro") :]
        assert tail == ["--remount-ro", "/", "--chdir", "/w/r", "--", *init]
        tmpfs, bind = argv.index("--tmpfs"), argv.index("--ro-bind")
        tmp = ["--perms", "1777", "--size", "4096", "--tmpfs", "/tmp"]
        assert argv[tmpfs - 4 : tmpfs + 2] == tmp
        assert argv[bind : bind + 3] == ["--ro-bind", "/usr", "/usr"]


def _tree(tmp_path: Path) -> dict[str, Path]:
    paths = {
        "project": tmp_path / "project",
        "state": tmp_path / "project" / ".harnessrl" / "controller",
        "workdir": tmp_path / "project" / ".harnessrl" / "episodes",
        "home": tmp_path / "home",
        "python": tmp_path / "home" / ".pyenv" / "versions" / "3.11",
        "private": tmp_path / "relay",
    }
    for path in paths.values():
        path.mkdir(parents=True, exist_ok=True)
    paths["run"] = paths["workdir"] / "g-0-1"
    paths["run"].mkdir()
    return paths


def _plan(paths: dict[str, Path], read_only: list[Path]) -> tuple[list[Mount], list[Path]]:
    return file_mounts(
        run_dir=paths["run"],
        read_only=read_only,
        hidden=[paths["state"], paths["workdir"], paths["private"]],
        masked=[paths["home"]],
        support={"/run/harnessrl/init.py": Path("/src/sandbox_init.py")},
        tmp_bytes=1 << 20,
    )


def _position(mounts: list[Mount], kind: str, dest: Path | str) -> int:
    return next(i for i, m in enumerate(mounts) if m.kind == kind and m.dest == str(dest))


def test_hidden_directories_are_masked_under_a_read_only_path_and_the_run_dir_shown_over_them(
    tmp_path: Path,
) -> None:
    paths = _tree(tmp_path)
    inside_state = paths["state"] / "runs.json"
    inside_state.write_text("{}")
    mounts, refused = _plan(paths, [paths["project"], paths["python"], inside_state])
    assert refused == [inside_state]  # nothing inside a hidden directory is ever mounted
    project = _position(mounts, "ro-bind", paths["project"])
    state_mask = _position(mounts, "tmpfs", paths["state"])
    workdir_mask = _position(mounts, "tmpfs", paths["workdir"])
    run = _position(mounts, "bind", paths["run"])
    assert project < state_mask and project < workdir_mask < run
    assert not any(m.kind == "bind" and m.dest != str(paths["run"]) for m in mounts)
    # HOME is not under a read-only path: not mounted at all, only the Python inside it.
    assert not any(m.dest == str(paths["home"]) and m.kind != "dir" for m in mounts)
    assert _position(mounts, "ro-bind", paths["python"]) > _position(mounts, "tmpfs", "/tmp")
    assert _position(mounts, "ro-bind", "/run/harnessrl/init.py") > _position(
        mounts, "tmpfs", "/run"
    )


def test_home_is_masked_where_shown_but_what_is_named_inside_it_stays_visible(
    tmp_path: Path,
) -> None:
    paths = _tree(tmp_path)
    mounts, _ = _plan(paths, [tmp_path, paths["python"]])
    home_mask = _position(mounts, "tmpfs", paths["home"])
    assert _position(mounts, "ro-bind", tmp_path) < home_mask
    assert home_mask < _position(mounts, "ro-bind", paths["python"])


def test_every_mount_comes_after_its_parents_which_are_made_traversable(tmp_path: Path) -> None:
    paths = _tree(tmp_path)
    mounts, _ = _plan(paths, [paths["python"]])
    seen: set[str] = {"/"}
    for mount in mounts:
        if mount.kind == "remount-ro":
            assert mount.dest in seen
            continue
        assert str(Path(mount.dest).parent) in seen or any(
            m.kind.endswith("bind") and Path(m.dest) in Path(mount.dest).parents
            for m in mounts[: mounts.index(mount)]
        ), mount
        seen.add(mount.dest)
    made = [m for m in mounts if m.kind == "dir"]
    assert made and all(m.perms == "0755" for m in made)
    # Under the writable /tmp, the way to the run is a tmpfs of its own, sealed read-only.
    if paths["run"].is_relative_to("/tmp"):
        first = Path("/tmp") / paths["run"].relative_to("/tmp").parts[0]
        assert Mount("remount-ro", str(first)) in mounts
        assert _position(mounts, "remount-ro", first) > _position(mounts, "bind", paths["run"])


def test_the_program_installation_and_file_arguments_are_found(tmp_path: Path) -> None:
    base = tmp_path / "opt" / "python3.11"
    (base / "bin").mkdir(parents=True)
    (base / "bin" / "python3").write_text("")
    (base / "bin" / "python3").chmod(0o755)
    venv = tmp_path / "opt" / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(base / "bin" / "python3")
    (venv / "pyvenv.cfg").write_text(f"home = {base / 'bin'}\n")
    script = tmp_path / "harness.py"
    script.write_text("")
    found = command_paths(
        ["python", str(script), str(tmp_path), "--flag", "/etc/hostname"],
        str(venv / "bin"),
        home=None,
    )
    assert found == [venv, base, base, script]  # a directory argument is not shown


def test_a_program_right_under_home_is_shown_alone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".cargo" / "bin").mkdir(parents=True)
    program = home / ".cargo" / "bin" / "codex"
    program.write_text("")
    program.chmod(0o755)
    assert command_paths(["codex"], str(program.parent), home=home) == [program, program]


def test_base_urls_point_at_the_relay_and_nothing_else_changes() -> None:
    env = {
        "OPENAI_BASE_URL": "http://10.0.0.5:8000/e/tok/v1",
        "ANTHROPIC_BASE_URL": "http://10.0.0.5:8000/e/tok",
        "OPENAI_API_KEY": "tok",
        "OTHER": "http://10.0.0.5:80001/x",
        "HOME": "/root",
        "PATH": "/usr/bin",
    }
    out = sandbox_env(env, "http://10.0.0.5:8000")
    assert out["OPENAI_BASE_URL"] == "http://127.0.0.1:8000/e/tok/v1"
    assert out["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8000/e/tok"
    assert out["OTHER"] == env["OTHER"] and out["OPENAI_API_KEY"] == "tok"
    assert out["HOME"] == "/tmp/home" and out["TMPDIR"] == "/tmp"
    assert out["PATH"] == "/usr/bin"
    named = sandbox_env({"OPENAI_BASE_URL": "https://gateway/e/t/v1"}, "https://gateway")
    assert named["OPENAI_BASE_URL"] == "https://gateway:443/e/t/v1"
    address = GatewayAddress.parse("https://gateway")
    assert (address.host, address.port, address.inside_host) == ("gateway", 443, "gateway")
    assert "127.0.0.1 localhost harnessrl gateway" in address.hosts_file()


def test_sandbox_settings_are_validated_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="read_only"):
        SandboxSettings(read_only=[Path("venv")])
    with pytest.raises(ValidationError, match="mode"):
        SandboxSettings(mode="docker")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="max_processes"):
        SandboxSettings(max_processes=0)
    with pytest.raises(ValidationError, match="uid_base"):
        SandboxSettings(uid_base=2**32)
    with pytest.raises(ValidationError, match=r"sandbox\.mode"):
        ControllerSection(runner="kubernetes", sandbox=SandboxSettings(mode="bwrap"))
    with pytest.raises(ValidationError, match="gateway_url"):
        ControllerSection(gateway_url="gateway:8000")
    assert SandboxSettings().mode == "off"
    assert SandboxSettings(max_address_space_bytes=None).max_address_space_bytes is None


def test_the_runner_is_sandboxed_as_the_mode_says(tmp_path: Path) -> None:
    def runner(**sandbox: object) -> object:
        section = ControllerSection(
            workdir=tmp_path / "w", state_dir=tmp_path / "s", sandbox=SandboxSettings(**sandbox)
        )
        return local_runner(section).sandbox

    assert runner() is None
    assert runner(mode="auto", bwrap="no-such-bwrap") is None  # warned: runs unsandboxed
    assert runner(mode="bwrap", bwrap="no-such-bwrap") is not None  # fails each launch
    assert runner(mode="auto", bwrap=sys.executable) is not None
