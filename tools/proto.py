"""Generate the Python stubs of the wire contract, or check that the committed ones are current.

    python tools/proto.py            # regenerate src/disttrain/proto/ from proto/ (make proto)
    python tools/proto.py --check    # exit 1, naming the files, when the committed stubs are stale

protoc writes absolute imports (`from disttrain.v1 import tensor_pb2`) that would resolve
inside this project's own `disttrain` package; they are rewritten to relative imports so the
stubs live in `disttrain.proto`. Only message classes are generated: the services' method
tables are built from them in the strategies' wire modules, which frame the hot messages
by hand.
The generator is pinned (grpcio-tools in the test extras) so its output is reproducible.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_PACKAGE = "disttrain/v1"
OUTPUT_DIR = REPO_ROOT / "src" / "disttrain" / "proto"
# The package's face: the stub modules, public as the wire contract; each loads when imported.
INIT_DOCSTRING = (
    '"""Generated protobuf message classes of proto/disttrain/v1 (regenerate with `make proto`).\n\n'
    "The wire contract, public as modules (`from disttrain.proto import parameter_server_pb2`),\n"
    'each loaded when first imported."""\n'
)
ABSOLUTE_IMPORT = re.compile(r"^from disttrain\.v1 import ", re.MULTILINE)


def generate(proto_root: Path = PROTO_ROOT) -> dict[str, str]:
    """Run protoc on every `.proto` under `proto_root/disttrain/v1`.

    Returns:
        File name -> text of every stub module, `__init__.py` included.
    Raises:
        RuntimeError: protoc failed (its message is included).
    """
    from grpc_tools import protoc

    sources = sorted((proto_root / PROTO_PACKAGE).glob("*.proto"))
    if not sources:
        raise RuntimeError(f"no .proto files under {proto_root / PROTO_PACKAGE}")
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{proto_root}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                *(str(s.relative_to(proto_root)) for s in sources)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(s.name for s in sources)}")
        out = {}
        for path in sorted((Path(tmp) / PROTO_PACKAGE).iterdir()):
            text = path.read_text()
            out[path.name] = ABSOLUTE_IMPORT.sub("from . import ", text)
    modules = ", ".join(f'"{Path(name).stem}"' for name in out if name.endswith(".py"))
    return {"__init__.py": f"{INIT_DOCSTRING}\n__all__ = [{modules}]\n", **out}


def stale_files(expected: dict[str, str], folder: Path = OUTPUT_DIR) -> list[str]:
    """Names of stub files in `folder` that differ from `expected`, are missing, or are extra."""
    found = {p.name for p in folder.glob("*.py*")} if folder.is_dir() else set()
    problems = [name for name, text in expected.items()
                if not (folder / name).is_file() or (folder / name).read_text() != text]
    problems += sorted(found - set(expected))
    return problems


def write(files: dict[str, str], folder: Path = OUTPUT_DIR) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for extra in stale_files(files, folder):
        if extra not in files:
            (folder / extra).unlink()
    for name, text in files.items():
        (folder / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--proto-root", type=Path, default=PROTO_ROOT)
    parser.add_argument("--output", type=Path, default=OUTPUT_DIR)
    args = parser.parse_args(argv)
    files = generate(args.proto_root)
    if args.check:
        stale = stale_files(files, args.output)
        if stale:
            print(f"stale generated stubs in {args.output}: {', '.join(stale)}; run `make proto` "
                  "and commit the result", file=sys.stderr)
            return 1
        print(f"{len(files)} stub files are current")
        return 0
    write(files, args.output)
    print(f"wrote {len(files)} stub files to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
