#!/usr/bin/env python3
"""Every code snippet of the README that names its source on its first line (a comment such as
`/* tests/package/consumer.c */`) must be taken from that file: its lines, stripped, appear there in
order ('...' marks an omission). Those sources are compiled and run by tests (install, python,
server-example), so a README snippet cannot drift from code that works.
Usage: check_readme_snippets.py SOURCE_ROOT"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
blocks = re.findall(r"```(?:c|cpp|python)\n(.*?)```", (root / "README.md").read_text(), flags=re.S)
problems, checked = [], 0
for block in blocks:
    lines = block.splitlines()
    m = re.fullmatch(r"\s*(?:/\*|//|#)\s*(\S+?)\s*(?:\*/)?\s*", lines[0]) if lines else None
    if not m or not (root / m.group(1)).is_file():
        continue
    source = [l.strip() for l in (root / m.group(1)).read_text().splitlines()]
    at = 0
    for line in (l.strip() for l in lines[1:]):
        if not line or line == "...":
            continue
        try:
            at = source.index(line, at) + 1
        except ValueError:
            problems.append(f"{m.group(1)}: README line not found (in order): {line}")
            break
    checked += 1
if checked < 3:
    problems.append(f"only {checked} README snippets name their source (expected the C, PyTorch and server ones)")
print(f"check_readme_snippets: {checked} snippets checked")
if problems:
    print("\n".join(problems))
    sys.exit(1)
