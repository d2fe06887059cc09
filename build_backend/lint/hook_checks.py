"""The fallback of ``python3 dev.py lint`` for DeepSpeed's three local pre-commit hooks.

Without ``--deepspeed-repo`` the lint command has no copy of DeepSpeed's ``scripts/`` to run, so
these functions state the same rules, written for this project (nothing here is taken from
DeepSpeed's scripts; they mirror what its hooks check, as DeepSpeed's ``.pre-commit-config.yaml``
runs them):

- ``check-torchdist`` (``scripts/check-torchdist.py``): DeepSpeed code talks to the process group
  through ``deepspeed.comm``; a line naming ``torch.distributed`` fails, except where it names
  ``torch.distributed.nn`` (``torch.distributed`` followed by a space fails as well);
- ``check-torchcuda`` (``scripts/check-torchcuda.py``): device code goes through
  ``get_accelerator()``; a line naming ``torch.cuda`` fails unless it carries ``#ignore-cuda``, and
  so does every ``.cuda()`` and, in a ``.py`` file, every ``.is_cuda``;
- ``check-license`` (``scripts/check-license.py``): a file needs a line that is exactly
  ``# SPDX-License-Identifier: Apache-2.0`` (or ``... Apache-2.0 AND BSD-3-Clause``, or either with
  ``//`` for C-like files) and a line that is exactly ``# DeepSpeed Team`` (or ``// DeepSpeed Team``),
  anywhere in the file.

Differences from the hooks themselves: DeepSpeed's torchcuda script stops at the first of its three
rules that matches (a file with ``torch.cuda`` is not also searched for ``.cuda()``); this reports
every rule's lines. The scripts search with ``git grep``; these read the file as UTF-8 (undecodable
bytes replaced) line by line, which for text files finds the same lines.

Each check returns ``[(line number or None for the whole file, message)]``; an empty list passes.
Stdlib only: the lint command imports this with the Python that runs ``dev.py``.
"""

import re
import sys
from pathlib import Path

# torch.distributed anywhere on the line, except as torch.distributed.nn; "torch.distributed "
# (with a space after it) always counts.
_TORCH_DIST = re.compile(r"torch\.distributed |torch\.distributed(?!\.nn)")
_LICENSE_LINES = (
    ("no line '# SPDX-License-Identifier: Apache-2.0'",
     re.compile(r"^(#|//) SPDX-License-Identifier: Apache-2\.0( AND BSD-3-Clause)?$", re.M)),
    ("no line '# DeepSpeed Team'", re.compile(r"^(#|//) DeepSpeed Team$", re.M)),
)


def _lines(path):
    return Path(path).read_text(encoding="utf-8", errors="replace").splitlines()


def check_torchdist(path):
    return [(n, f"torch.distributed (use deepspeed.comm): {line.strip()}") for n, line in enumerate(_lines(path), 1)
            if _TORCH_DIST.search(line)]


def check_torchcuda(path):
    out = []
    for n, line in enumerate(_lines(path), 1):
        if "torch.cuda" in line and "#ignore-cuda" not in line:
            out.append((n, f"torch.cuda (use get_accelerator(), or mark the line #ignore-cuda): {line.strip()}"))
        if ".cuda()" in line:
            out.append((n, f".cuda() (use .to(get_accelerator().device_name())): {line.strip()}"))
        if str(path).endswith(".py") and ".is_cuda" in line:
            out.append((n, f".is_cuda (use get_accelerator().on_accelerator(tensor)): {line.strip()}"))
    return out


def check_license(path):
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return [(None, f"missing license header: {what}") for what, pattern in _LICENSE_LINES
            if not pattern.search(text)]


CHECKS = {
    "check-torchdist": check_torchdist,
    "check-torchcuda": check_torchcuda,
    "check-license": check_license,
}


def main(argv):
    """``python hook_checks.py HOOK FILE...``: print each finding as ``FILE:LINE: message``; exit 1 on any."""
    if len(argv) < 1 or argv[0] not in CHECKS:
        print(f"usage: hook_checks.py {{{','.join(CHECKS)}}} FILE...", file=sys.stderr)
        return 2
    failed = False
    for path in argv[1:]:
        for line, message in CHECKS[argv[0]](path):
            failed = True
            print(f"{path}:{line}: {message}" if line else f"{path}: {message}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
