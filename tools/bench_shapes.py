"""Check that benchmark JSON keeps the shape of the full runs' (its keys, nested).

A quick run (`make bench-quick`) stands in for a full one (`make bench`) wherever a
script's output is read, so it must write the same keys at every level, with smaller
sizes. The full runs' shapes are recorded in benchmarks/shapes.json:

    python tools/bench_shapes.py runs/bench-quick             # compare with benchmarks/shapes.json
    python tools/bench_shapes.py runs/bench-quick --against runs/bench   # with full runs' JSON
    python tools/bench_shapes.py runs/bench --write           # record them (after `make bench`)

A shape is the JSON with every value other than an object or a list replaced by null; a
list's shape is the merged shape of its items (the union of their keys). Two shapes differ
where an object misses a key the other has, or one holds an object or a list where the
other holds something else. An empty list matches any list, and a null matches an object
(an optional figure left out). A benchmark that skipped (a "skipped" key: what it needs is
missing here) is listed apart, not compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SHAPES = REPO_ROOT / "benchmarks" / "shapes.json"


def shape(value: Any) -> Any:
    """The shape of a JSON value: objects keep their keys, lists one merged item, the rest null."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        merged = None
        for item in value:
            merged = merge(merged, shape(item))
        return [merged] if value else []
    return None


def merge(first: Any, second: Any) -> Any:
    """One shape holding both: the union of the keys of two objects, recursively."""
    if isinstance(first, dict) and isinstance(second, dict):
        return {key: merge(first.get(key), second.get(key)) for key in {**first, **second}}
    if isinstance(first, list) and isinstance(second, list):
        if not first or not second:
            return first or second
        return [merge(first[0], second[0])]
    return second if first is None else first


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Where `actual`'s shape departs from `expected`'s, one line each (empty: the same).

    Args:
        expected: a shape (see `shape`), e.g. the full run's.
        actual: the shape to check, e.g. the quick run's.
        path: where these shapes sit in the document, for the messages.
    """
    where = path or "the top level"
    if isinstance(expected, dict) and isinstance(actual, dict):
        found = [f"{where}: missing key {key!r}" for key in expected if key not in actual]
        found += [f"{where}: extra key {key!r}" for key in actual if key not in expected]
        for key in [key for key in expected if key in actual]:
            found += differences(expected[key], actual[key], f"{path}.{key}" if path else key)
        return found
    if isinstance(expected, list) and isinstance(actual, list):
        return differences(expected[0], actual[0], f"{path}[]") if expected and actual else []
    if expected is None or actual is None:
        return []
    kinds = {dict: "an object", list: "a list"}
    return [f"{where}: {kinds[type(actual)]} where the full run has {kinds[type(expected)]}"]


def read_runs(folder: Path) -> dict[str, Any]:
    """The benchmark JSON files of a folder, by their "benchmark" name (other files are left out)."""
    runs = {}
    for path in sorted(folder.glob("*.json")):
        document = json.loads(path.read_text())
        if isinstance(document, dict) and "benchmark" in document:
            runs[document["benchmark"]] = document
    return runs


def compare(expected: dict[str, Any], runs: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(differences, skipped benchmarks) of `runs` (documents) against `expected` (shapes)."""
    found, skipped = [], []
    for name, document in runs.items():
        if "skipped" in document:
            skipped.append(f"{name}: {document['skipped']}")
        elif name not in expected:
            found.append(f"{name}: no full-run shape recorded (run `make bench`, then "
                         f"`python tools/bench_shapes.py runs/bench --write`)")
        else:
            found += [f"{name}: {line}" for line in differences(expected[name], shape(document))]
    return found, skipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a folder of benchmark JSON (as --output writes it)")
    parser.add_argument("--against", type=Path, default=SHAPES,
                        help="the recorded shapes (a .json file) or a folder of full runs' JSON "
                             "(default: benchmarks/shapes.json)")
    parser.add_argument("--write", action="store_true",
                        help="record the folder's shapes in benchmarks/shapes.json instead")
    args = parser.parse_args()
    runs = read_runs(args.folder)
    if not runs:
        print(f"{args.folder}: no benchmark JSON here (*.json with a 'benchmark' key)", file=sys.stderr)
        return 1
    if args.write:
        skipped = sorted(name for name, document in runs.items() if "skipped" in document)
        if skipped:
            print(f"not recording {', '.join(skipped)}: skipped in this run", file=sys.stderr)
        recorded = json.loads(SHAPES.read_text()) if SHAPES.is_file() else {}
        recorded.update({name: shape(d) for name, d in runs.items() if name not in skipped})
        SHAPES.write_text(json.dumps(dict(sorted(recorded.items())), indent=1, sort_keys=True) + "\n")
        print(f"recorded the shapes of {len(runs) - len(skipped)} benchmark(s) in {SHAPES}")
        return 0
    if args.against.is_dir():
        expected = {name: shape(d) for name, d in read_runs(args.against).items() if "skipped" not in d}
    else:
        expected = json.loads(args.against.read_text())
    found, skipped = compare(expected, runs)
    for line in skipped:
        print(f"skipped, not compared: {line}")
    for line in found:
        print(line)
    compared = len(runs) - len(skipped)
    print(f"{compared} benchmark(s) compared with {args.against}: "
          + (f"{len(found)} difference(s)" if found else "the same keys at every level"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
