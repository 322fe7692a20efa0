"""docs/kernels.md's kernel table, rendered from the records (each `Kernel.row`, `Kernel.attrs` and
name, family by family), and the command that keeps the file current:
`python -m streamsched.stdlib.kernels --doc [FILE]` rewrites the table between the markers of FILE
(default: the repository's docs/kernels.md), `--check` exits 1 when FILE differs, `--table`
prints the table.  Nothing outside the markers is touched, and a file without them is refused.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from streamsched.stdlib.kernel_record import Kernel

BEGIN = ("<!-- kernel table: generated from the records by `python -m streamsched.stdlib.kernels --doc`; "
         "edit the records, not this table -->")
END = "<!-- end of the generated kernel table -->"
HEADER = ("| kernel | inputs -> outputs | attrs (defaults) | formula | stream |\n"
          "|---|---|---|---|---|")
DOC = Path(__file__).resolve().parents[4] / "docs" / "kernels.md"
"""docs/kernels.md of the source tree this package lives in (src/streamsched/stdlib/kernels/)."""


def value_text(v: Any) -> str:
    """An attribute default as the table shows it: true/false/none, "text", [2, 3], 1e-5."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(value_text(x) for x in v) + "]"
    if isinstance(v, float):
        return re.sub(r"e([-+])0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), repr(v))
    return str(v)


def attrs_text(rec: Kernel) -> str:
    """The attrs cell: `name=default` in the record's order; a run of attributes that must be given
    (`DocRow.required`) as `a, b (required)`."""
    required = set(rec.row.required) if rec.row else set()
    parts: list[str] = []
    run: list[str] = []
    for name, default in rec.attrs.items():
        if name in required:
            run.append(name)
            continue
        if run:
            parts.append(", ".join(run) + " (required)")
            run = []
        parts.append(f"{name}={value_text(default)}")
    if run:
        parts.append(", ".join(run) + " (required)")
    return ", ".join(parts)


def _split(side: str) -> list[str]:
    """The parameter names of one side of a signature ("x [..., c], gamma [c]" -> x, gamma)."""
    side = side.strip()
    if side == "()":
        return []
    parts, depth, cur = [], 0, ""
    for ch in side:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.split()[0] if p.split() else "" for p in parts]


def check_row(rec: Kernel) -> None:
    """ValueError unless rec has a row whose signature names exactly its inputs and outputs, in
    order, and whose `required` attributes are attributes of rec without a default."""
    row = rec.row
    if row is None:
        raise ValueError(f"kernel {rec.name} has no doc row (DocRow)")
    ins, arrow, outs = row.signature.partition(" -> ")
    if not arrow:
        raise ValueError(f"kernel {rec.name}: signature {row.signature!r} has no ' -> '")
    got = (tuple(_split(ins)), tuple(_split(outs)))
    if got != (rec.inputs, rec.outputs):
        raise ValueError(f"kernel {rec.name}: signature {row.signature!r} names {got[0]} -> {got[1]}, "
                         f"the record {rec.inputs} -> {rec.outputs}")
    bad = [a for a in row.required if rec.attrs.get(a, 0) is not None]
    if bad:
        raise ValueError(f"kernel {rec.name}: required attribute {bad[0]!r} is not one without a default")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table(families: Sequence | None = None) -> str:
    """The generated block, markers included: per family a heading naming its module and one row
    per record.  ValueError for a record whose row does not match it (check_row)."""
    if families is None:
        from streamsched.stdlib.kernels import FAMILIES as families
    out = [BEGIN]
    for fam in families:
        path = "src/" + fam.module.replace(".", "/") + ".py"
        out += ["", f"### {fam.title} (`{path}`)", "", HEADER]
        for rec in fam.kernels.values():
            check_row(rec)
            cells = (f"`{rec.name}`", rec.row.signature, attrs_text(rec), rec.row.formula, rec.row.stream)
            out.append("|" + "|".join(f" {_cell(c)} " if c else " " for c in cells) + "|")
    out += ["", END]
    return "\n".join(out)


def update(text: str, table: str | None = None) -> str:
    """text with its generated block replaced by `table` (default: render_table()); ValueError
    when text lacks the markers (one of each, BEGIN first)."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i or text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"no generated kernel table: the file needs one line {BEGIN!r} and, after it, one {END!r}")
    return text[:i] + (render_table() if table is None else table) + text[j + len(END):]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m streamsched.stdlib.kernels`: see the module docstring.  Exit status 0, 1 for a
    --check that found the file stale, 2 for a file that cannot be read or has no markers."""
    p = argparse.ArgumentParser(prog="python -m streamsched.stdlib.kernels",
                                description="docs/kernels.md's kernel table, generated from the records")
    p.add_argument("--doc", nargs="?", const=str(DOC), metavar="FILE",
                   help=f"rewrite the table in FILE (default {DOC})")
    p.add_argument("--check", action="store_true", help="with --doc: only say whether FILE is current (exit 1 if not)")
    p.add_argument("--table", action="store_true", help="print the table")
    args = p.parse_args(argv)
    if args.table:
        print(render_table())
    if args.doc is None:
        if not args.table:
            p.print_usage(sys.stderr)
            return 2
        return 0
    path = Path(args.doc)
    try:
        old = path.read_text(encoding="utf-8")
        new = update(old)
    except (OSError, ValueError) as exc:
        print(f"error: {path}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if old == new:
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                   str(path), "generated"))
        print(f"{path} is stale: run `python -m streamsched.stdlib.kernels --doc`", file=sys.stderr)
        return 1
    if old != new:
        path.write_text(new, encoding="utf-8")
        print(f"rewrote the kernel table in {path}")
    return 0
