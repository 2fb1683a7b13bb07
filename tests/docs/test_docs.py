"""The docs cannot rot: examples run, shown code is the tested code, references match the code.

* every ``docs_src/*.py`` runs (in-process, with the installed plugins loaded, as for a user);
* every fenced block preceded by ``<!-- docs_src/<path> -->`` is byte-for-byte that file;
* every ``python`` block in ``docs/`` is either such a block or a checked hook signature;
* ``docs/plugins/hooks.md`` gives every hookspec with its exact signature and firstresult flag;
* ``docs/cli.md`` documents exactly the commands of the typer app, and its examples exit 0;
* the plugin tutorial's package works as the tutorial says: its test suite passes against it
  installed through its metadata (fast), and, ``pip install -e``'d into a fresh venv (slow), both
  its tests and the tutorial's script pass.
"""

from __future__ import annotations

import inspect
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from qplug_core.cli.app import app
from qplug_core.registry import hookspecs, plugins
from qplug_core.testing.dists import child_venv, pip_install_into, write_dist_info

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
SRC = REPO / "docs_src"
TINY = SRC / "plugin_tiny"

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```\s*$", re.S | re.M)
MARKER = re.compile(r"<!-- (docs_src/[^ ]+|hookspec) -->\s*\n\s*\Z")
DOC_FILES = sorted(DOCS.rglob("*.md"))
EXAMPLES = sorted(SRC.glob("*.py"))


def fenced_blocks(path: Path) -> list[tuple[str, str, str | None]]:
    """``(language, code, marker)`` of every fenced block; marker is what the comment before it names."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = MARKER.search(text[:match.start()])
        blocks.append((match.group(1), match.group(2), before.group(1) if before else None))
    return blocks


def test_docs_exist():
    names = {p.relative_to(DOCS).as_posix() for p in DOC_FILES}
    for required in ["index.md", "quickstart.md", "cli.md", "migrating.md", "security.md",
                     "guide/static-ptq.md", "guide/qat.md", "guide/dynamic.md", "guide/eager.md",
                     "concepts/patterns.md", "concepts/observers.md", "concepts/ir.md",
                     "concepts/partitioning.md", "plugins/writing-a-backend.md",
                     "plugins/hooks.md", "plugins/testing-your-plugin.md"]:
        assert required in names, f"docs/{required} is missing"


# -- (a) every example runs --------------------------------------------------------------------


@pytest.fixture
def isolated_example(plugin_autoload, monkeypatch):
    """Run an example as a user would (all installed plugins), then undo what it did to the process."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    plugins.reset()


#: examples that run after the user installed something, and how the test installs it
NEEDS_TINY = {"writing_a_backend.py"}
#: example -> (distribution, entry point value, entry point name, package folder)
NEEDS_PLUGIN = {"delegates.py": ("qplug-numpy-int", "qplug_numpy_int.plugin:plugin", "numpy_int",
                                 SRC / "plugin_numpy_int"),
                "fusion_backend.py": ("qplug-tiny-conv", "qplug_tiny_conv.plugin:plugin", "tiny_conv",
                                      SRC / "plugin_tiny_conv")}


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(example: Path, isolated_example, fake_dist, capsys):
    if example.name in NEEDS_TINY:  # what `pip install -e docs_src/plugin_tiny` leaves behind
        fake_dist("qplug-tiny", module="qplug_tiny.plugin:plugin", entry_point="tiny",
                  version="0.1.0", location=TINY)
    if example.name in NEEDS_PLUGIN:
        dist, module, name, location = NEEDS_PLUGIN[example.name]
        fake_dist(dist, module=module, entry_point=name, version="0.1.0", location=location)
    runpy.run_path(str(example), run_name="__main__")
    assert capsys.readouterr().out, f"{example.name} printed nothing"


def _tutorial_env(*paths: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPLUG_")}
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return env


def test_plugin_tutorial_test_suite_passes(tmp_path):
    """docs_src/plugin_tiny/tests against the plugin installed through its metadata on the path."""
    write_dist_info(tmp_path, "qplug-tiny", "0.1.0", {"tiny": "qplug_tiny.plugin:plugin"})
    result = subprocess.run([sys.executable, "-m", "pytest", str(TINY / "tests"), "-q",
                             "-p", "no:cacheprovider", "--rootdir", str(TINY)], cwd=TINY,
                            env=_tutorial_env(tmp_path, TINY, REPO), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_plugin_tutorial_installs_with_pip(tmp_path):
    """The tutorial's main path: ``pip install -e`` of the package (a copy, to keep the tree
    clean) into a fresh venv, then its tests and the tutorial's script, as a user runs them."""
    package = tmp_path / "plugin_tiny"
    shutil.copytree(TINY, package, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    python = child_venv(tmp_path / "venv")
    install = pip_install_into(python, "--no-deps", "-e", str(package))
    assert install.returncode == 0, install.stderr
    tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                           cwd=package, env=_tutorial_env(), capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    script = subprocess.run([str(python), str(SRC / "writing_a_backend.py")], cwd=tmp_path,
                            env=_tutorial_env(), capture_output=True, text=True, timeout=300)
    assert script.returncode == 0, script.stderr[-3000:]
    assert "tiny::linear" in script.stdout


def test_plugin_tutorial_is_written_against_the_plugin_api_only():
    source = (TINY / "qplug_tiny" / "plugin.py").read_text()
    assert len(source.splitlines()) <= 60
    imported = {line.split()[1] for line in source.splitlines() if line.startswith(("from ", "import "))}
    assert {m for m in imported if m.startswith("qplug_core")} == {"qplug_core.plugin_api"}


# -- (b) shown code is tested code -------------------------------------------------------------


@pytest.mark.parametrize("doc", DOC_FILES, ids=[p.relative_to(DOCS).as_posix() for p in DOC_FILES])
def test_marked_blocks_match_their_files(doc: Path):
    for language, code, marker in fenced_blocks(doc):
        if marker is None or marker == "hookspec":
            continue
        source = REPO / marker
        assert source.is_file(), f"{doc.name} includes {marker}, which does not exist"
        assert code == source.read_text(), (
            f"{doc.relative_to(REPO)}: the block marked {marker} differs from the file; "
            "copy the file into the block again")


@pytest.mark.parametrize("doc", DOC_FILES, ids=[p.relative_to(DOCS).as_posix() for p in DOC_FILES])
def test_every_python_block_is_tested(doc: Path):
    for language, code, marker in fenced_blocks(doc):
        if language in ("python", "py", "pycon"):
            assert marker is not None, (
                f"{doc.relative_to(REPO)}: untested python block starting {code[:60]!r}; put it in "
                "docs_src/ and mark it with <!-- docs_src/<file> -->")


def test_every_example_is_shown_somewhere():
    shown = {marker for doc in DOC_FILES for _, _, marker in fenced_blocks(doc) if marker}
    files = {p.relative_to(REPO).as_posix() for p in SRC.rglob("*")
             if p.is_file() and p.suffix in (".py", ".toml") and "__pycache__" not in p.parts
             and p.name != "__init__.py"}
    assert not files - shown, f"examples no page shows: {sorted(files - shown)}"


# -- hooks.md is the hookspec reference --------------------------------------------------------


def hookspec_functions() -> dict[str, object]:
    return {name: fn for name, fn in vars(hookspecs).items()
            if name.startswith("qplug_") and callable(fn)}


def hooks_doc_sections() -> dict[str, str]:
    text = (DOCS / "plugins" / "hooks.md").read_text()
    parts = re.split(r"^### `(qplug_\w+)`\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_hooks_doc_lists_every_hookspec():
    assert sorted(hooks_doc_sections()) == sorted(hookspec_functions())


@pytest.mark.parametrize("name", sorted(hookspec_functions()))
def test_hooks_doc_signature_and_firstresult(name):
    section = hooks_doc_sections()[name]
    fn = hookspec_functions()[name]
    expected = f"def {name}{inspect.signature(fn)}: ...\n".replace("'", "")
    blocks = [code for lang, code, marker in
              ((m.group(1), m.group(2), "hookspec") for m in FENCE.finditer(section))
              if lang == "python"]
    assert blocks and blocks[0] == expected, f"hooks.md {name}: expected signature block {expected!r}"
    firstresult = fn.qplug_spec["firstresult"]
    assert f"**firstresult:** {'yes' if firstresult else 'no'}" in section
    assert "**versionadded:** 0.1" in section


# -- cli.md ------------------------------------------------------------------------------------


def app_commands() -> set[str]:
    return set(typer.main.get_command(app).commands)


def test_cli_doc_lists_every_command():
    text = (DOCS / "cli.md").read_text()
    documented = set(re.findall(r"^### `qplug ([\w-]+)`", text, flags=re.M))
    assert documented == app_commands(), (
        f"docs/cli.md sections {sorted(documented)} != commands of the app {sorted(app_commands())}")


def cli_examples() -> list[str]:
    lines = []
    for lang, code, _ in fenced_blocks(DOCS / "cli.md"):
        if lang == "console":
            lines += [line[2:] for line in code.splitlines()
                      if line.startswith("$ qplug ") and "# not-run" not in line]
    return lines


@pytest.fixture(scope="module")
def cli_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for all examples, in page order: ``report`` reads what ``quantize`` wrote."""
    return tmp_path_factory.mktemp("cli_examples")


@pytest.mark.parametrize("line", cli_examples())
def test_cli_examples_succeed(line, plugin_autoload, cli_workdir, monkeypatch):
    monkeypatch.chdir(cli_workdir)
    command, _, expected = line.partition("  # exit ")
    args = shlex.split(command)[1:]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == int(expected or 0), result.output
