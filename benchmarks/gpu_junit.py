"""Did the CUDA tests run?  Reads pytest's JUnit XML files: exit 1 (one line per test) when a test
was skipped or none ran, so a GPU check whose CUDA tests skipped (no CUDA in the process, a missing
wheel) fails instead of passing on nothing.  Run by benchmarks/gpu_check.sh.

    python -m benchmarks.gpu_junit FILE.xml [FILE.xml ...]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

MAX_XML_BYTES = 16 << 20


def problems(paths: list[str]) -> list[str]:
    """What is wrong with the runs in ``paths``: skipped tests, files without tests, unreadable files."""
    out: list[str] = []
    for name in paths:
        path = Path(name)
        try:
            if path.stat().st_size > MAX_XML_BYTES:
                out.append(f"{name}: larger than {MAX_XML_BYTES} bytes")
                continue
            root = ET.fromstring(path.read_bytes())
        except (OSError, ET.ParseError) as e:
            out.append(f"{name}: not a readable JUnit XML file ({e})")
            continue
        cases = list(root.iter("testcase"))
        if not cases:
            out.append(f"{name}: no test ran")
        for case in cases:
            skip = case.find("skipped")
            if skip is not None:
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                out.append(f"{name}: skipped {test}: {skip.get('message', '')}")
    return out


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m benchmarks.gpu_junit FILE.xml [...]", file=sys.stderr)
        return 2
    found = problems(paths)
    for line in found:
        print(line)
    if not found:
        print(f"gpu_junit: every test ran ({len(paths)} file(s))")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
