#!/usr/bin/env python3
"""Checks that libmoegraph.so exports the documented API and nothing else.

Usage: check_exports.py LIBMOEGRAPH.so INCLUDE_DIR

- The C symbols (mg_*) must be exactly the functions moegraph.h declares with MOEGRAPH_API.
- Every other exported symbol must belong to a moegraph:: declaration marked MOEGRAPH_API in the
  C++ headers (a class: its members, typeinfo and vtable; a function: its overloads).
- The SONAME must carry the major version (libmoegraph.so.N).
Prints the counts; on failure lists what is missing or exported by mistake, and exits 1."""
import pathlib
import re
import subprocess
import sys

lib, include = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
headers = include / "moegraph"

c_declared = set(re.findall(r"MOEGRAPH_API\s[^;(]*?\b(mg_\w+)\s*\(", (headers / "moegraph.h").read_text()))
cpp_names = set()
for h in sorted(headers.glob("*.hpp")):
    text = h.read_text()
    cpp_names.update(re.findall(r"\b(?:class|struct)\s+MOEGRAPH_API\s+(\w+)", text))
    cpp_names.update(re.findall(r"MOEGRAPH_API\s+[^;{(]*?\b(\w+)\s*\(", text))
if not c_declared or not cpp_names:
    sys.exit(f"check_exports: found no MOEGRAPH_API declarations under {headers}")

raw = subprocess.run(["nm", "-D", "--defined-only", str(lib)], check=True, capture_output=True, text=True).stdout
symbols = [line.split()[-1] for line in raw.splitlines() if line.strip()]
demangled = subprocess.run(["c++filt"], input="\n".join(symbols), check=True, capture_output=True,
                           text=True).stdout.splitlines()

c_exported, cpp_exported, wrong = set(), [], []
entity = re.compile(r"^(?:typeinfo name for |typeinfo for |vtable for |VTT for )?moegraph::(?:detail::)?(\w+)")
for sym, name in zip(symbols, demangled):
    if sym.startswith("mg_"):
        c_exported.add(sym)
        continue
    m = entity.match(name)
    if m and m.group(1) in cpp_names:
        cpp_exported.append(name)
    else:
        wrong.append(name)

soname = re.search(r"\(SONAME\)\s+Library soname: \[(.*?)\]",
                   subprocess.run(["readelf", "-d", str(lib)], check=True, capture_output=True, text=True).stdout)
problems = []
if c_declared - c_exported:
    problems.append("declared in moegraph.h but not exported: " + ", ".join(sorted(c_declared - c_exported)))
if c_exported - c_declared:
    problems.append("exported but not declared in moegraph.h: " + ", ".join(sorted(c_exported - c_declared)))
if wrong:
    problems.append(f"{len(wrong)} exported symbols outside the documented API, e.g.:\n    " + "\n    ".join(wrong[:25]))
if not soname or not re.fullmatch(r"libmoegraph\.so\.\d+", soname.group(1)):
    problems.append(f"SONAME {soname.group(1) if soname else None!r} is not libmoegraph.so.<major>")

print(f"check_exports: {len(c_exported)} C functions, {len(cpp_exported)} C++ symbols of "
      f"{len(cpp_names)} public names, SONAME {soname.group(1) if soname else None}")
if problems:
    print("check_exports: FAILED\n  " + "\n  ".join(problems))
    sys.exit(1)
