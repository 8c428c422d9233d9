"""The protobuf contracts: generated code is current, and every field is documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "libs" / "harnessrl" / "v1"


def test_generated_code_matches_the_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = tmp_path / "harnessrl" / "v1"
    fresh_files = {p.name: p.read_bytes() for p in fresh.iterdir() if p.is_file()}
    committed = {p.name: p.read_bytes() for p in GENERATED.iterdir() if p.is_file()}
    assert sorted(fresh_files) == sorted(committed), "generated file set differs: run make protos"
    stale = [name for name, data in fresh_files.items() if committed[name] != data]
    assert not stale, f"stale generated code (run `make protos`): {stale}"


def test_every_proto_field_has_a_comment() -> None:
    field = re.compile(r"^\s*(optional |repeated )?[\w.<>, ]+ \w+ = \d+;")
    undocumented = []
    for proto in sorted((ROOT / "protos").rglob("*.proto")):
        lines = proto.read_text().splitlines()
        for number, line in enumerate(lines):
            if field.match(line) and not lines[number - 1].strip().startswith("//"):
                undocumented.append(f"{proto.name}:{number + 1}: {line.strip()}")
    assert not undocumented, "fields without a comment:\n" + "\n".join(undocumented)


def test_token_ids_and_logprobs_are_packed() -> None:
    from harnessrl.v1 import events_pb2 as pb

    call = pb.ModelCall(prompt_token_ids=[1, 2, 3], completion_logprobs=[-0.5, -1.0])
    data = call.SerializeToString()
    # Packed: one tag per field, not one per element.
    assert data.count(bytes([8 << 3 | 2])) == 1
    assert data.count(bytes([10 << 3 | 2])) == 1
