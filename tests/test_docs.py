"""Documentation stays true: every diagnostic code the code can emit has an entry in
docs/errors.md, every stdlib kernel appears in docs/kernels.md, and the README's commands are the
ones CI runs."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*p):
    with open(os.path.join(ROOT, *p), encoding="utf-8") as f:
        return f.read()


def test_every_code_is_documented():
    used = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "src", "streamsched")):
        for f in files:
            if f.endswith(".py"):
                used |= set(re.findall(r'"([PSCRX]\d{3})"', _read(dirpath, f)))
    documented = set(re.findall(r"^## ([PSCRX]\d{3}):", _read("docs", "errors.md"), re.M))
    assert used, "no codes found"
    assert used <= documented, sorted(used - documented)


def test_ci_runs_the_readme_test_command():
    readme = _read("README.md")
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) >= 2
    install_and_run = block[0].split("#")[0].strip()
    test_cmd = block[1].split("#")[0].strip()
    assert "streamsched run examples/mlp_digits.sched" in install_and_run
    assert test_cmd in _read(".ci", "run")


def test_kernel_table_is_generated_from_the_records():
    """docs/kernels.md's kernel table is exactly what the records render (their rows, attribute
    defaults and families); regenerate it with `python -m streamsched.stdlib.kernels --doc`."""
    from streamsched.stdlib.kernels._doc import update

    text = _read("docs", "kernels.md")
    assert text == update(text), "docs/kernels.md is stale: run `python -m streamsched.stdlib.kernels --doc`"
