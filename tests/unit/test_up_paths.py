"""Where `harnessrl up` runs a config from: the relative paths a config names (the model, the
tokenizer, the harness's script) resolve from the working directory, unless the config file's
own directory or a parent of it holds more of them; so the shipped configs work from anywhere."""

from __future__ import annotations

from pathlib import Path

import yaml

from harnessrl.apps.cli.up import project_dir

ROOT = Path(__file__).resolve().parents[2]


def test_a_shipped_config_runs_from_the_repository_wherever_up_is_started(tmp_path: Path) -> None:
    config = ROOT / "examples" / "up.yaml"
    assert project_dir(config, tmp_path) == ROOT
    assert project_dir(config, ROOT) == ROOT
    assert project_dir(ROOT / "examples" / "calculator" / "demo.yaml", tmp_path) == ROOT


def test_paths_relative_to_the_working_directory_keep_it(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "models" / "mine").mkdir(parents=True)
    configs = tmp_path / "configs"
    configs.mkdir()
    config = configs / "stack.yaml"
    config.write_text(yaml.safe_dump({"inference": {"model": "models/mine"}}))
    assert project_dir(config, work) == work
    # Started elsewhere, nothing holds the path: the working directory, and the service's
    # own check names the missing model.
    assert project_dir(config, tmp_path) == tmp_path


def test_urls_and_unreadable_configs_change_nothing(tmp_path: Path) -> None:
    config = tmp_path / "a" / "stack.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump({"controller": {"gateway_url": "http://gateway:8000/v1"}}))
    assert project_dir(config, tmp_path / "a") == tmp_path / "a"
    broken = tmp_path / "broken.yaml"
    broken.write_text("inference: [")
    assert project_dir(broken, tmp_path / "a") == tmp_path / "a"
