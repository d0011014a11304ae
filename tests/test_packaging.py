"""Packaging: one version, a library that needs no third-party package, the ``cli`` extra's
one-line refusal, the README quick start on PostgreSQL, and the wheel's files and metadata.

Missing packages are simulated in a child process whose path finder refuses them, so the tests
run in the development environment, where every extra is installed.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import pkgutil
import re
import shutil
import subprocess
import sys
import tomllib
import uuid
import zipfile
from pathlib import Path

import fenced
from fenced.testing.postgres import PostgresServer

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = {"cli", "etcd", "http", "metrics", "postgres", "s3", "server", "testing", "zookeeper"}

# Replaces the path finder by one that finds nothing for the top-level names REFUSE(name) is true
# of: to the program, those packages are not installed (`import click` is ModuleNotFoundError).
WITHOUT = """
import sys
from importlib.machinery import PathFinder

class _Without(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if REFUSE(name.partition(".")[0]):
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [_Without if f is PathFinder else f for f in sys.meta_path]
"""

ONLY_STDLIB = (
    "REFUSE = lambda top: top not in sys.stdlib_module_names and top != 'fenced'\n" + WITHOUT
)
NO_CLI = "REFUSE = lambda top: top in ('click', 'rich')\n" + WITHOUT


def run_python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_version_is_the_package_metadata_of_pyproject() -> None:
    assert fenced.__version__ == importlib.metadata.version("fenced")
    assert fenced.__version__ == PYPROJECT["project"]["version"]
    source = (ROOT / "src" / "fenced" / "__init__.py").read_text()
    assert f'"{fenced.__version__}"' not in source  # not written a second time


def test_fenced_version_prints_the_metadata_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fenced", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"fenced, version {fenced.__version__}\n"


def test_the_library_runs_on_the_standard_library_alone(tmp_path: Path) -> None:
    """``pip install fenced`` (no extra): import, coordinator, both local stores, guard."""
    code = ONLY_STDLIB + (
        "for name in ('click', 'rich', 'pytest', 'psycopg', 'grpc'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit(f'{name} was not refused')\n"
        "import sqlite3\n"
        "import fenced, fenced.observe, fenced.verify\n"
        "with fenced.connect('sqlite:coord.db') as coord,"
        " fenced.open_store('sqlite:store.db') as store,"
        " fenced.open_store('file:files') as files:\n"
        "    with coord.hold('jobs/a', ttl=30, wait=5, fence=[store, files]) as held:\n"
        "        store.put(held.token, 'k', b'v')\n"
        "        files.publish(held.token, b'data')\n"
        "        with sqlite3.connect('app.db', isolation_level=None) as conn:\n"
        "            conn.execute('BEGIN IMMEDIATE')\n"
        "            fenced.guard(conn, held.token)\n"
        "            conn.execute('COMMIT')\n"
        "    print(store.get('jobs/a', 'k').epoch, files.read('jobs/a'))\n"
        "third = sorted({m.partition('.')[0] for m in sys.modules}"
        " - set(sys.stdlib_module_names) - {'fenced'})\n"
        "print(*third)\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "1 b'data'"
    # Only what the interpreter's start-up (.pth files of the venv) imported before the finder.
    assert not {"click", "rich", "pytest", "psycopg", "grpc"} & set(lines[1].split())


def test_the_command_without_the_cli_extra_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="fenced")
    assert entry.value == "fenced.__main__:main"
    for how in (  # the console script as installed, and python -m fenced
        "import importlib.metadata as m\n"
        "(e,) = m.entry_points(group='console_scripts', name='fenced')\n"
        "e.load()()",
        "import runpy\nrunpy.run_module('fenced', run_name='__main__')",
    ):
        result = run_python(NO_CLI + how, tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stdout == ""
        assert result.stderr == (
            "fenced: the command line needs click and rich: pip install 'fenced[cli]'\n"
        )


def test_only_the_cli_imports_click_and_rich_contract_covers_every_subpackage() -> None:
    (contract,) = [
        c
        for c in PYPROJECT["tool"]["importlinter"]["contracts"]
        if c.get("forbidden_modules") == ["click", "rich"]
    ]
    parts = {f"fenced.{m.name}" for m in pkgutil.iter_modules(fenced.__path__)}
    assert set(contract["source_modules"]) == parts - {"fenced.cli", "fenced.__main__"}


def test_the_readme_lists_every_published_extra() -> None:
    optional = PYPROJECT["project"]["optional-dependencies"]
    assert set(optional) == EXTRAS
    assert PYPROJECT["project"]["dependencies"] == []
    assert set(PYPROJECT["dependency-groups"]) == {"dev", "bench"}
    readme = (ROOT / "README.md").read_text()
    assert set(re.findall(r"^\| `(\w+)` \|", readme, re.MULTILINE)) == EXTRAS
    assert optional["cli"] == ["click>=8.1", "rich>=13.0"]
    assert optional["testing"] == ["pytest>=8.0", "pytest-asyncio>=0.24"]


def _quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### In your own program\n", 1)[1].split("\n### ", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    return str(block)


def test_the_readme_quick_start_runs_on_postgresql(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """tests/test_docs_examples.py runs it without DATABASE_URL (the embedded default)."""
    name = "qs_" + uuid.uuid4().hex[:12]
    url = postgres_server.create_database(name)
    try:
        result = run_python(_quick_start(), tmp_path, DATABASE_URL=url)
        assert result.returncode == 0, result.stderr
        assert "Item(resource='reports/daily', key='total', epoch=1, version=1)" in result.stdout
        assert not (tmp_path / ".fenced").exists()  # nothing local: all of it in PostgreSQL
        with fenced.open_store(url) as store:
            item = store.get("reports/daily", "total")
        assert item is not None and item.epoch == 1
    finally:
        postgres_server.drop_database(name)


def test_the_wheel_has_the_license_the_package_data_and_the_extras(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(
        ROOT / "src",
        tree / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    offline = ["--no-deps", "--no-build-isolation", "--no-index", "--disable-pip-version-check"]
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", *offline, "-w", str(tmp_path / "dist"), str(tree)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("fenced-*.whl")
    version = PYPROJECT["project"]["version"]
    assert wheel.name == f"fenced-{version}-py3-none-any.whl"
    info = f"fenced-{version}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Copyright 2026 fenced maintainers" in license_text
    etcd = "fenced/coordinator/backends/etcd/"
    for data in ("fenced/py.typed", f"{etcd}_rpc.pyi", f"{etcd}etcd_rpc.binpb"):
        assert data in names, data
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert set(metadata.get_all("Provides-Extra") or []) == EXTRAS
    requires = metadata.get_all("Requires-Dist") or []
    assert all("; extra ==" in r for r in requires), requires  # nothing for a plain install
    click = [r for r in requires if r.startswith(("click", "rich"))]
    assert click == ['click>=8.1; extra == "cli"', 'rich>=13.0; extra == "cli"']
    assert "Typing :: Typed" in (metadata.get_all("Classifier") or [])
    assert "fenced = fenced.__main__:main" in entry_points
