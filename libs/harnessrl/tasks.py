"""Task files: JSON lines of tasks to submit, validated before anything is sent.

Each line is one JSON object:

    {"task_id": "add-17", "input": {...}, "split": "train", "group_size": 8, "metadata": {...}}

`task_id` (non-empty string), `input` (any JSON value) and `split` ("train" or "val") are
required; `group_size` (1-1024) and `metadata` (an object) are optional. Blank lines are
skipped. Unknown fields are refused, so a typo never silently drops a setting.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from harnessrl.v1 import events_pb2 as pb


class TaskFileError(ValueError):
    """A line of a task file is invalid; the message names the line and the field."""

    def __init__(self, path: Path, line: int, field: str | None, reason: str) -> None:
        where = f"{path}:{line}"
        super().__init__(f"{where}: field '{field}': {reason}" if field else f"{where}: {reason}")
        self.line = line
        self.field = field


class TaskLine(BaseModel):
    """One task as written in a task file."""

    model_config = ConfigDict(extra="forbid", strict=True)

    task_id: str = Field(min_length=1, max_length=256)
    """The user's id for the task."""
    input: Any
    """The task input handed to the harness (any JSON value; required, may be null)."""
    split: Literal["train", "val"]
    """train tasks are trained on; val tasks are only measured."""
    group_size: int | None = Field(default=None, ge=1, le=1024)
    """Episodes to run for the task (default: the controller's)."""
    metadata: dict[str, Any] | None = None
    """Free-form metadata for the controller and the reward (expected answer, ...)."""


def new_group_id() -> str:
    """A fresh group id: unique per submission, short enough to read in logs."""
    return f"g-{secrets.token_hex(8)}"


def to_event(task: TaskLine, group_id: str) -> pb.TaskSubmitted:
    return pb.TaskSubmitted(
        task_id=task.task_id,
        group_id=group_id,
        split=pb.MODE_TRAIN if task.split == "train" else pb.MODE_VAL,
        input_json=orjson.dumps(task.input).decode(),
        group_size=task.group_size or 0,
        metadata_json=orjson.dumps(task.metadata or {}).decode(),
    )


def parse_task_file(path: Path) -> list[TaskLine]:
    """Every task of the file, or TaskFileError for the first bad line (nothing partial)."""
    tasks = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError as err:
                raise TaskFileError(path, number, None, f"not valid JSON: {err}") from None
            if not isinstance(data, dict):
                raise TaskFileError(path, number, None, "must be a JSON object")
            try:
                tasks.append(TaskLine.model_validate(data))
            except ValidationError as err:
                first = err.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or None
                raise TaskFileError(path, number, field, first["msg"]) from None
    return tasks
