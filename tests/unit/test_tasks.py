"""Task files: valid lines become TaskSubmitted; a bad line is named with its field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.tasks import TaskFileError, new_group_id, parse_task_file, to_event
from harnessrl.v1 import events_pb2 as pb


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_valid_lines_become_events(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        json.dumps(
            {
                "task_id": "a",
                "input": {"q": "1+1"},
                "split": "train",
                "group_size": 4,
                "metadata": {"answer": 2},
            }
        ),
        "",
        json.dumps({"task_id": "b", "input": None, "split": "val"}),
    )
    tasks = parse_task_file(path)
    assert [t.task_id for t in tasks] == ["a", "b"]
    event = to_event(tasks[0], "g-1")
    assert event.split == pb.MODE_TRAIN
    assert json.loads(event.input_json) == {"q": "1+1"}
    assert event.group_size == 4
    assert json.loads(event.metadata_json) == {"answer": 2}
    assert to_event(tasks[1], "g-2").split == pb.MODE_VAL
    assert to_event(tasks[1], "g-2").metadata_json == "{}"


@pytest.mark.parametrize(
    ("line", "field", "reason"),
    [
        ('{"task_id": "a", "input": 1, "split": "test"}', "split", "'train' or 'val'"),
        ('{"task_id": "a", "split": "train"}', "input", "required"),
        ('{"task_id": "", "input": 1, "split": "train"}', "task_id", "at least 1"),
        ('{"task_id": 5, "input": 1, "split": "train"}', "task_id", "string"),
        (
            '{"task_id": "a", "input": 1, "split": "train", "group_size": 0}',
            "group_size",
            "greater than or equal",
        ),
        ('{"task_id": "a", "input": 1, "split": "train", "metadata": []}', "metadata", "dict"),
        ('{"task_id": "a", "input": 1, "split": "train", "extra": 1}', "extra", "not permitted"),
    ],
)
def test_bad_line_names_line_and_field(tmp_path: Path, line: str, field: str, reason: str) -> None:
    good = '{"task_id": "ok", "input": 1, "split": "train"}'
    path = _write(tmp_path, good, line)
    with pytest.raises(TaskFileError) as info:
        parse_task_file(path)
    assert info.value.line == 2
    assert info.value.field == field
    assert f":2: field '{field}'" in str(info.value)
    assert reason.lower() in str(info.value).lower()


def test_lines_that_are_not_json_objects(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match=r":1: not valid JSON"):
        parse_task_file(_write(tmp_path, "{oops"))
    with pytest.raises(TaskFileError, match=r":1: must be a JSON object"):
        parse_task_file(_write(tmp_path, "[1, 2]"))


def test_group_ids_are_unique() -> None:
    ids = {new_group_id() for _ in range(1000)}
    assert len(ids) == 1000
