"""`harnessrl up`'s stack file and the record of hand-opened episodes beside it: private from
the moment they exist, what they say, and how `up` plans the gateway access they carry."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.apps.up import manual_episodes
from harnessrl.apps.up.plan import UpError, build_plan
from harnessrl.apps.up.stackfile import (
    MANUAL_EPISODES_FILE,
    STACK_FILE,
    GatewayAccess,
    StackFileError,
    read_gateway_access,
    remove_stack_files,
    write_stack_file,
)

ROOT = Path(__file__).resolve().parents[2]
ACCESS = GatewayAccess(
    url="http://127.0.0.1:8000",
    admin_url="http://127.0.0.1:8001",
    token_secret="s" * 43,
    admin_token="a" * 43,
)


@pytest.fixture
def umask() -> Iterator[None]:
    """The most permissive umask, so only the code's own mode keeps others out."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_stack_file_is_owner_only_whatever_the_umask(tmp_path: Path, umask: None) -> None:
    path = tmp_path / STACK_FILE
    write_stack_file(path, {"bootstrap": "127.0.0.1:9092"}, ACCESS)
    assert _mode(path) == 0o600
    os.umask(0o777)  # takes the owner's bits too: the file must still be readable by them
    write_stack_file(path, {"bootstrap": "127.0.0.1:9092"}, ACCESS)
    assert _mode(path) == 0o600
    assert read_gateway_access(path) == ACCESS


def test_stack_file_replaces_a_readable_one_and_a_temporary_file_left_behind(
    tmp_path: Path, umask: None
) -> None:
    path = tmp_path / STACK_FILE
    path.write_text("{}")
    path.chmod(0o644)  # written by an older `up`
    (tmp_path / f"{STACK_FILE}.tmp").write_text("half")  # from a writer killed mid-write
    write_stack_file(path, {"bootstrap": "b"}, ACCESS)
    assert _mode(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [STACK_FILE]


def test_stack_file_holds_what_is_given_and_the_gateway_access(tmp_path: Path) -> None:
    path = tmp_path / STACK_FILE
    write_stack_file(path, {"bootstrap": "127.0.0.1:9092", "services": {}}, ACCESS)
    data = json.loads(path.read_text())
    assert data == {
        "bootstrap": "127.0.0.1:9092",
        "services": {},
        "gateway": {
            "url": "http://127.0.0.1:8000",
            "admin_url": "http://127.0.0.1:8001",
            "token_secret": "s" * 43,
            "admin_token": "a" * 43,
        },
    }


def test_gateway_access_never_shows_its_secrets() -> None:
    assert "s" * 43 not in repr(ACCESS)
    assert "a" * 43 not in repr(ACCESS)


def test_a_stack_file_without_gateway_access_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / STACK_FILE
    path.write_text(json.dumps({"bootstrap": "b", "services": {}}))
    with pytest.raises(StackFileError, match="gateway"):
        read_gateway_access(path)
    path.write_text("not json")
    with pytest.raises(StackFileError, match=str(path)):
        read_gateway_access(path)


def test_removing_the_stack_files_takes_both_and_may_repeat(tmp_path: Path) -> None:
    write_stack_file(tmp_path / STACK_FILE, {}, ACCESS)
    manual_episodes.record_new(tmp_path / MANUAL_EPISODES_FILE, "g-1", "val", 1e10)
    remove_stack_files(tmp_path)
    remove_stack_files(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_up_plans_one_gateway_access_for_the_gateway_and_the_controller(tmp_path: Path) -> None:
    plan = build_plan(ROOT / "examples" / "up.yaml", tmp_path, "http://127.0.0.1:4317")
    env = {spec.name: spec.env for spec in plan.children}
    access = plan.gateway
    assert access.url == access.admin_url
    assert env["gateway"]["HARNESSRL_GATEWAY__PORT"] == access.url.rsplit(":", 1)[1]
    assert "HARNESSRL_GATEWAY__ADMIN_PORT" not in env["gateway"]
    assert env["gateway"]["HARNESSRL_GATEWAY__TOKEN_SECRET"] == access.token_secret
    assert env["gateway"]["HARNESSRL_GATEWAY__ADMIN_TOKEN"] == access.admin_token
    assert env["controller"]["HARNESSRL_CONTROLLER__TOKEN_SECRET"] == access.token_secret
    assert env["controller"]["HARNESSRL_CONTROLLER__ADMIN_TOKEN"] == access.admin_token
    assert env["controller"]["HARNESSRL_CONTROLLER__GATEWAY_ADMIN_URL"] == access.admin_url
    assert len(access.token_secret) >= 32 and len(access.admin_token) >= 32
    assert access.token_secret != access.admin_token
    again = build_plan(ROOT / "examples" / "up.yaml", tmp_path, "http://127.0.0.1:4317")
    assert again.gateway.token_secret != access.token_secret  # generated per run


def test_up_gives_a_configured_admin_port_a_free_port_and_tells_the_controller(
    tmp_path: Path,
) -> None:
    config = tmp_path / "up.yaml"
    base = (ROOT / "examples" / "up.yaml").read_text()
    config.write_text(base.replace("gateway:\n", "gateway:\n  admin_port: 8001\n", 1))
    plan = build_plan(config, tmp_path, "http://127.0.0.1:4317")
    env = {spec.name: spec.env for spec in plan.children}
    admin_port = env["gateway"]["HARNESSRL_GATEWAY__ADMIN_PORT"]
    assert plan.gateway.admin_url == f"http://127.0.0.1:{admin_port}" != plan.gateway.url
    assert env["controller"]["HARNESSRL_CONTROLLER__GATEWAY_ADMIN_URL"] == plan.gateway.admin_url


def test_hand_opened_episodes_are_numbered_per_group_in_a_private_record(
    tmp_path: Path, umask: None
) -> None:
    path = tmp_path / MANUAL_EPISODES_FILE
    first = manual_episodes.record_new(path, "g-a", "val", 100.0)
    second = manual_episodes.record_new(path, "g-a", "train", 200.0)
    other = manual_episodes.record_new(path, "g-b", "val", 300.0)
    assert (first.episode_id, second.episode_id) == ("g-a-manual-0", "g-a-manual-1")
    assert other.episode_id == "g-b-manual-0"
    assert first.attempt == second.attempt == 1
    assert _mode(path) == 0o600
    assert manual_episodes.find(path, "g-a-manual-1") == second
    assert manual_episodes.find(path, "g-a-manual-7") is None
    assert manual_episodes.find(tmp_path / "none.jsonl", "g-a-manual-0") is None


def test_episodes_opened_at_once_get_distinct_ids(tmp_path: Path) -> None:
    path = tmp_path / MANUAL_EPISODES_FILE
    ids: list[str] = []

    def open_one() -> None:
        ids.append(manual_episodes.record_new(path, "g-same", "val", 1e10).episode_id)

    threads = [threading.Thread(target=open_one) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(ids) == sorted(f"g-same-manual-{i}" for i in range(16))


def test_a_damaged_record_is_reported_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / MANUAL_EPISODES_FILE
    manual_episodes.record_new(path, "g-a", "val", 100.0)
    with path.open("a") as record:
        record.write('{"episode_id": "x"}\n')
    with pytest.raises(StackFileError, match=f"{MANUAL_EPISODES_FILE}:2"):
        manual_episodes.find(path, "g-a-manual-0")


def test_up_leaves_out_the_trainer_and_builder_when_asked_and_nothing_else(
    tmp_path: Path,
) -> None:
    plan = build_plan(ROOT / "examples" / "up.yaml", tmp_path, "http://127.0.0.1:4317",
                      frozenset({"trainer", "sample-builder"}))  # fmt: skip
    names = [spec.name for spec in plan.children]
    assert names == ["broker", "inference", "gateway", "reward", "controller"]
    assert plan.config == (ROOT / "examples" / "up.yaml").resolve()
    with pytest.raises(UpError, match="--without gateway: only sample-builder, trainer"):
        build_plan(ROOT / "examples" / "up.yaml", tmp_path, "x", frozenset({"gateway"}))
