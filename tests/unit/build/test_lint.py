# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python3 dev.py lint``: DeepSpeed's pre-commit hooks on the exported pull requests' Python files
(build_backend/lint/zero3muon_lint.py). No torch.

The command needs the pinned linters in ``.venv/lint/`` (requirements/lint.txt, from PyPI); where that
venv cannot be created, every test here skips. Files planted in tmp_path (``--paths``):

- a file with an unused import, ``import torch.distributed``, ``torch.cuda``, yapf-unformatted
  code, trailing whitespace, blank lines at the end and no license fails each of those hooks, and
  a clean file passes them all (the fallback: build_backend/lint/'s own settings and checks);
- ``--fix`` formats a file in place with yapf;
- with ``--deepspeed-repo``, a small DeepSpeed-like checkout made here: the hooks, args, excludes
  and local scripts of its ``.pre-commit-config.yaml`` are what runs;
- a patched upstream file counts only what the patch brings: the release's own findings are
  listed apart, and yapf judges only the patch's lines where the release's file fails yapf.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO_ROOT / "build_backend" / "lint"))
import zero3muon_lint as zl  # noqa: E402

HEADER = "# Copyright (c) 2026 The zero3muon authors\n# SPDX-License-Identifier: Apache-2.0\n\n# DeepSpeed Team\n"

CLEAN = HEADER + '''"""A module every hook passes."""

import math


def area(radius):
    return math.pi * radius**2
'''

BAD = HEADER + "\n".join([
    "import os",  # unused: flake8 F401
    "import torch.distributed as dist",  # check-torchdist
    "",
    "",
    "def world():",
    "    x = [1,2,",  # yapf
    "      3]",
    "    return dist.get_world_size() + len(x)  ",  # trailing-whitespace
    "torch.cuda.synchronize()",  # check-torchcuda; flake8 F821 (torch undefined)
    "",
    "",  # end-of-file-fixer: blank lines at the end
    "",
])


def line_of(text, needle):
    return next(n for n, line in enumerate(text.splitlines(), 1) if needle in line)


def _load_dev():
    spec = importlib.util.spec_from_file_location("zero3muon_dev_lint", REPO_ROOT / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lint_bin():
    """.venv/lint/bin, created or updated as ``dev.py lint`` does; skip where it cannot be."""
    dev = _load_dev()
    try:
        venv = dev.lint_venv()
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f".venv/lint/ cannot be created here (pip install -r requirements/lint.txt): {e}")
    return venv.python.parent


def dev_lint(*args):
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "dev.py"), "lint", *map(str, args)],
                          cwd=REPO_ROOT,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True,
                          timeout=600)
    return proc.returncode, proc.stdout


def findings(out, name):
    """{hook: [text after 'hook: ']} of the finding lines of the file named ``name`` in the report ``out``."""
    result, current = {}, None
    for line in out.splitlines():
        if line.startswith("[lint]   FAIL "):
            current = line[len("[lint]   FAIL "):].split(":")[0].split(" (patched)")[0]
        elif current and line.startswith("[lint]        "):
            hook, _, text = line[len("[lint]        "):].partition(": ")
            if Path(current).name == name:
                result.setdefault(hook, []).append(text)
        else:
            current = None
    return result


def test_planted_violations_fail_and_a_clean_file_passes(lint_bin, tmp_path):
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "nolicense.py").write_text(CLEAN[len(HEADER):])
    (tmp_path / "clean.py").write_text(CLEAN)
    rc, out = dev_lint("--paths", tmp_path / "bad.py", tmp_path / "nolicense.py", tmp_path / "clean.py")
    assert rc == 1, out
    bad = findings(out, "bad.py")
    unused, torch_ref = line_of(BAD, "import os"), line_of(BAD, "torch.cuda")
    assert bad.get("flake8") == [
        f"{unused}: F401 'os' imported but unused", f"{torch_ref}: F821 undefined name 'torch'"
    ], out
    assert [t.split(":")[0] for t in bad.get("check-torchdist", [])] == [str(line_of(BAD, "torch.distributed"))], out
    assert [t.split(":")[0] for t in bad.get("check-torchcuda", [])] == [str(torch_ref)], out
    assert [t.split(":")[0] for t in bad.get("trailing-whitespace", [])] == [str(line_of(BAD, "len(x)"))], out
    assert [t.split(":")[0] for t in bad.get("yapf", [])] == [str(line_of(BAD, "x = [1,2"))], out
    assert len(bad.get("end-of-file-fixer", [])) == 1, out
    assert "check-license" not in bad and "codespell" not in bad, out
    assert sorted(findings(out, "nolicense.py")) == ["check-license"], out
    assert findings(out, "clean.py") == {} and "ok   1 file(s): clean.py" in out, out

    rc, out = dev_lint("--paths", tmp_path / "clean.py")
    assert rc == 0, out
    assert "total: no findings" in out


def test_fix_formats_in_place(lint_bin, tmp_path):
    f = tmp_path / "unformatted.py"
    f.write_text(HEADER + "import math\nx = [math.pi,\n  2]\ndef f( a ):\n    return a\n")
    rc, out = dev_lint("--paths", f)
    assert rc == 1 and "yapf" in findings(out, "unformatted.py"), out
    rc, out = dev_lint("--fix", "--paths", f)
    assert rc == 0, out
    assert f"fixed (yapf -i): {f}" in out
    assert f.read_text() == HEADER + "import math\n\nx = [math.pi, 2]\n\n\ndef f(a):\n    return a\n"


FAKE_CONFIG = r"""repos:
-   repo: meta
    hooks:
    -   id: check-useless-excludes
-   repo: https://github.com/pre-commit/pre-commit-hooks
    rev: v5.0.0
    hooks:
    -   id: trailing-whitespace
    -   id: check-json
-   repo: https://github.com/google/yapf
    rev: v0.40.0
    hooks:
    -   id: yapf
-   repo: https://github.com/pycqa/flake8
    rev: 5.0.4
    hooks:
    -   id: flake8
        args: ['--config=.flake8']
-   repo: https://github.com/codespell-project/codespell
    rev: v2.0.0
    hooks:
    -   id: codespell
-   repo: local
    hooks:
    -   id: check-nofoo
        name: check-nofoo
        entry: ./scripts/check-nofoo.py
        language: python
        exclude: ^allowed/
"""

NOFOO = '''#!/usr/bin/env python3
import sys
bad = [f for f in sys.argv[1:] if "FOO" in open(f).read()]
if bad:
    print(f"{bad}: FOO found", file=sys.stderr)
    sys.exit(1)
'''


def test_deepspeed_checkout_config_is_what_runs(lint_bin, tmp_path):
    ds = tmp_path / "DeepSpeed"
    (ds / "scripts").mkdir(parents=True)
    (ds / ".pre-commit-config.yaml").write_text(FAKE_CONFIG)
    (ds / ".style.yapf").write_text("[style]\nbased_on_style = pep8\ncolumn_limit = 40\n")
    (ds / ".flake8").write_text("[flake8]\nselect = F401\n")
    (ds / "scripts" / "check-nofoo.py").write_text(NOFOO)
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.py").write_text("import os\nimport sys\n\nx = 'FOO'\n\n\ndef f(aaaaaaaaaa, bbbbbbbbbb, cccccccccc):\n"
                                "    return sys.argv\n")
    (files / "b.py").write_text("y = 1  \n")
    rc, out = dev_lint("--deepspeed-repo", ds, "--paths", files / "a.py", files / "b.py")
    assert rc == 1, out
    a = findings(out, "a.py")
    assert a.get("flake8") == ["1: F401 'os' imported but unused"], out  # F401 only: the checkout's .flake8
    assert a.get("check-nofoo") == ["['a.py']: FOO found"], out  # the checkout's own script
    assert [t.split(":")[0] for t in a.get("yapf", [])] == ["7"], out  # column_limit 40: the def is too long
    assert [t.split(":")[0] for t in findings(out, "b.py").get("trailing-whitespace", [])] == ["1"], out
    assert "not run: check-json (JSON files only)" in out
    assert "not run: check-useless-excludes" in out
    assert "pins https://github.com/codespell-project/codespell at v2.0.0" in out  # requirements/lint.txt has 2.1.0
    rc, out = dev_lint("--paths", files / "a.py")
    assert "yapf" not in findings(out, "a.py"), out  # the fallback's 119 columns

    (files / "a.py").write_text("import sys\n\nx = sys.argv\n")
    rc, out = dev_lint("--deepspeed-repo", ds, "--paths", files / "a.py")
    assert rc == 0, out


def _settings(lint_bin):
    return zl.fallback_settings(lint_bin)


def test_patched_upstream_file_counts_what_the_patch_brings(lint_bin, tmp_path):
    release = HEADER + "import os\nx = [1,\n  2]\n\n\ndef f():\n    return 1\n"  # F401 os, not yapf-formatted
    patched = release.replace("    return 1\n", "    import sys\n    y=2\n    return y\n")  # F401 sys, y=2
    target = zl.Target("1-test", "a test", [], {"deepspeed/mod.py": (release.encode(), patched.encode())})
    work = tmp_path / "work"
    work.mkdir()
    settings = _settings(lint_bin)
    own = zl.lint_release([target], settings, work)
    assert {f.hook for f in own} == {"flake8", "yapf"}
    zl.lint_target(target, settings, tmp_path, work, own)
    got = sorted((f.hook, f.line, f.text) for f in target.findings)
    assert ("flake8", 11, "F401 'sys' imported but unused") in got, got
    assert [f.hook for f in target.findings if f.hook == "flake8"] == ["flake8"], got  # not os: the release's
    assert [f.line for f in target.findings if f.hook == "yapf"] == [12], got  # y=2 only, not the release's x
    assert any("does not pass yapf" in n for n in target.notes), target.notes
    assert sorted(f.hook for f in target.upstream_own) == ["flake8", "yapf"]


def test_each_pull_requests_files(lint_bin, tmp_path, monkeypatch):
    """On this repository: each group's Python files are its own modules and tests plus the release
    files its patches change, patched (they differ from the release's)."""
    import zero3muon_build as zb
    cfg = zb.load_config(REPO_ROOT)
    base = cfg["default-base"]
    # Under another base's test run the sdist variable names that base's sdist: look this one up
    # in the cache (or download it) instead.
    monkeypatch.delenv(zb.ENV_SDIST, raising=False)
    try:
        sdist = zb.obtain_sdist(base, cfg["sdist-sha256"][base])
    except zb.BuildError as e:
        pytest.skip(f"no deepspeed-{base} sdist here: {str(e).splitlines()[0]}")
    release = zl.Release(sdist)
    try:
        found, _ = zl.targets(base, REPO_ROOT, release, tmp_path)
    finally:
        release.close()
    by_stem = {t.stem: t for t in found}
    assert list(by_stem)[:6] == [
        "1-zero3-muon", "2-zero3-configurations", "3-zero12-muon", "4-universal-checkpoints", "5-muon-config",
        "6-muon-variants"
    ]
    muon = "deepspeed/runtime/zero/muon"
    zero_tests = "tests/unit/runtime/zero"
    stage3, stage12, engine = (f"deepspeed/runtime/{p}.py" for p in ("zero/stage3", "zero/stage_1_and_2", "engine"))
    # the seed fix: 0004 patches original_muon.py, 0001 stage3.py; the core modules and their tests are new files
    seed = by_stem["1-zero3-muon"]
    assert sorted(seed.patched) == [f"{muon}/original_muon.py", stage3]
    assert [p for p in seed.ours if p.startswith("deepspeed/")] == ["deepspeed/runtime/rank_agreement.py"] + [
        f"{muon}/{m}.py"
        for m in ("binding", "config", "momentum", "newton_schulz", "owner_exchange", "owner_plan", "owner_state",
                  "param_record", "pipeline", "support")
    ]
    assert {f"{zero_tests}/test_muon_update_split.py", f"{zero_tests}/test_zero3_muon_boundary.py"} <= set(seed.ours)
    configurations = by_stem["2-zero3-configurations"]
    assert list(configurations.patched) == [stage3]
    assert all(p.startswith((zero_tests, "testing/muon_testing/")) for p in configurations.ours)
    assert {f"{zero_tests}/zero3_muon_helpers.py", "testing/muon_testing/reference.py"} <= set(configurations.ours)
    assert sorted(by_stem["3-zero12-muon"].patched) == [stage12]
    assert sorted(by_stem["4-universal-checkpoints"].patched) == sorted(
        ["deepspeed/checkpoint/ds_to_universal.py", "deepspeed/runtime/bf16_optimizer.py", engine, stage3, stage12])
    assert sorted(by_stem["5-muon-config"].patched) == ["deepspeed/__init__.py", engine]
    assert f"{muon}/integration.py" in by_stem["5-muon-config"].ours
    variants = by_stem["6-muon-variants"]
    assert sorted(variants.patched) == sorted([f"{muon}/__init__.py", f"{muon}/original_muon.py"])
    assert {f"{muon}/polar_express.py", f"{muon}/normuon.py", f"{muon}/qk_clip.py", f"{muon}/hf_attention.py",
            f"{zero_tests}/test_zero3_normuon.py"} <= set(variants.ours)
    for t in found:
        assert all(p.endswith(".py") and (REPO_ROOT / p).is_file() for p in t.ours), t.stem
        for rel, (old, new) in t.patched.items():
            assert rel.endswith(".py") and old != new, (t.stem, rel)
