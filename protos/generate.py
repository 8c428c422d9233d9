"""Generate the Python code for the protobuf contracts under protos/.

Usage: python protos/generate.py [--out DIR]

Writes messages (`*_pb2.py`), gRPC stubs (`*_pb2_grpc.py`) and their type stubs (`*.pyi`,
by mypy-protobuf) into DIR (default: libs/), under the proto package path (harnessrl/v1/).
The output depends only on the .proto files and the pinned grpcio-tools and mypy-protobuf
versions, which is what tests/unit/test_protos.py checks against the committed code.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("harnessrl/**/*.proto"))


def generate(out: Path) -> list[Path]:
    """Generate into `out`; returns the files written. Raises RuntimeError on protoc failure."""
    from grpc_tools import protoc

    plugin_dir = Path(sys.executable).parent
    mypy_plugin = shutil.which("protoc-gen-mypy", path=str(plugin_dir)) or shutil.which(
        "protoc-gen-mypy"
    )
    mypy_grpc_plugin = shutil.which("protoc-gen-mypy_grpc", path=str(plugin_dir)) or shutil.which(
        "protoc-gen-mypy_grpc"
    )
    if mypy_plugin is None or mypy_grpc_plugin is None:
        raise RuntimeError("mypy-protobuf is not installed (pip install -e '.[dev]')")
    well_known = resources.files("grpc_tools") / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={mypy_plugin}",
        f"--plugin=protoc-gen-mypy_grpc={mypy_grpc_plugin}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {files}")
    package_dirs = {(out / f).parent for f in files}
    for d in package_dirs:
        init = d / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated protobuf code: do not edit; run `make protos`."""\n')
    return sorted(p for d in package_dirs for p in d.iterdir() if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "libs")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
