# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python -m deepspeed.runtime.zero.muon``: one line saying whether this DeepSpeed has the ZeRO-3 Muon patch.

On the patched build, for example::

    deepspeed 0.19.8+zero3muon: upstream 0.19.8, zero3muon 0.1.0, ZeRO-3 Muon update: owner-centric at the
    accumulation boundary (patches 0001-zero3-muon-boundary-update, 0002-zero3-grad-partition-first-use-in-window,
    0003-zero3-unscale-by-backward-loss-scale, 0004-muon-update-split)

(one line), exit status 0. ``python -m deepspeed.runtime.zero.muon plan --config config.json --world-size W``
prints the owner plan Muon's step would run for a Hugging Face model (``plan_report``). The facts come from
``_build_info.py``, which the build backend (``build_backend/zero3muon_build.py``) writes into this package: the
versions, the patch names, and
``PATCHED_FILES``, the sha256 of every file of the package the patches change as it was built. The
report hashes the installed files and compares, so it needs nothing but the installed package (no
repository, no patch files). Anything else (a stock DeepSpeed, a missing or changed patched file, a
version that does not match the build info) is reported on the same one line, with exit status 1.
(Importing DeepSpeed may log a line of its own before it, e.g. the accelerator auto-detection
warning when ``DS_ACCELERATOR`` is not set.)
"""

import hashlib
import sys
from pathlib import Path

LOCAL_LABEL = "+zero3muon"
MODE = "owner-centric at the accumulation boundary"


def _patch_name(filename):
    return filename[:-len(".patch")] if filename.endswith(".patch") else filename


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def unpatched_files(package, patched_files):
    """The installed files that are not as the build patched them.

    Args:
        package (Path): the installed ``deepspeed`` package directory.
        patched_files (dict[str, str]): ``_build_info.PATCHED_FILES``: path relative to ``package`` ->
            lowercase hex sha256 of the file as built.

    Returns:
        list[str]: ``"<file> (missing)"``, ``"<file> (sha256 differs)"`` or ``"<file> (unreadable: <error>)"``
        for each file that does not match, ``<file>`` its full path, in the order of ``patched_files``;
        empty when all match. Raises nothing for a file (an unreadable one is listed), so the report
        stays one line whatever the installation looks like.
    """
    package = Path(package)
    problems = []
    for rel, expected in patched_files.items():
        path = package / rel
        if not path.is_file():
            problems.append(f"{path} (missing)")
            continue
        try:
            actual = _sha256(path)
        except OSError as exc:
            problems.append(f"{path} (unreadable: {exc.strerror or exc})")
            continue
        if actual != str(expected).lower():
            problems.append(f"{path} (sha256 differs)")
    return problems


def report_for(version, package, info):
    """``(exit_status, line)`` for a DeepSpeed of ``version`` installed at ``package`` with build info ``info``.

    Args:
        version (str): ``deepspeed.__version__``.
        package (Path): the directory of the installed ``deepspeed`` package.
        info: the ``_build_info`` module (or any object with its attributes ``BASE_VERSION``,
            ``PATCH_VERSION``, ``PATCHES`` and ``PATCHED_FILES``).

    Returns:
        tuple[int, str]: 0 and the line naming versions, mode and patches when the version is the build's
        and every patched file has the recorded sha256; else 1 and a line saying ``NOT the patched one``
        and why (including a build info without ``PATCHED_FILES``, written by an older build backend).
    """
    head = f"deepspeed {version}: upstream {info.BASE_VERSION}, zero3muon {info.PATCH_VERSION}"
    problems = []
    if version != f"{info.BASE_VERSION}{LOCAL_LABEL}":
        problems.append(f"the version is not {info.BASE_VERSION}{LOCAL_LABEL} "
                        "(another DeepSpeed installed over the build?)")
    patched_files = getattr(info, "PATCHED_FILES", None)
    if patched_files is None:
        problems.append("its _build_info.py has no PATCHED_FILES to check the installed files against "
                        "(written by an older zero3muon build backend; reinstall the build)")
    else:
        changed = unpatched_files(package, patched_files)
        if changed:
            problems.append(f"file(s) not as the build patched them: {', '.join(changed)}")
    if problems:
        return 1, f"{head}, ZeRO-3 Muon update: NOT the patched one: {'; '.join(problems)}"
    patches = ", ".join(_patch_name(p) for p in info.PATCHES)
    return 0, f"{head}, ZeRO-3 Muon update: {MODE} (patches {patches})"


def report():
    """``(exit_status, line)`` describing the installed DeepSpeed (see ``report_for``)."""
    import deepspeed
    version = deepspeed.__version__
    try:
        from deepspeed.runtime.zero.muon import _build_info as info
    except ImportError:
        return 1, (f"deepspeed {version}: not the zero3muon build (no deepspeed/runtime/zero/muon/_build_info.py); "
                   "ZeRO-3 Muon runs upstream's update. Install it with `pip install .` from the zero3muon "
                   "repository.")
    return report_for(version, Path(deepspeed.__file__).parent, info)


def main(argv=None):
    """No arguments: the one-line report (module docstring). ``plan ...``: the owner plan report
    (``plan_report``: ``python -m deepspeed.runtime.zero.muon plan --help``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        from deepspeed.runtime.zero.muon import plan_report
        return plan_report.main(argv[1:])
    if argv:
        print(f"usage: python -m deepspeed.runtime.zero.muon [plan --help]; unknown arguments {argv}", file=sys.stderr)
        return 2
    status, line = report()
    print(line, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
