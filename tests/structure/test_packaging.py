"""What the installed package contains: the kernels under `hypic_rag.kernels`, the bundled model and example corpus,
no training or synthetic-data code, and nothing installed under the import name `kernels` (Hugging Face's kernels
library owns it; the kernels live inside the package, so a clone has no top-level `kernels` folder to shadow it); and the build says nothing about our
configuration (no deprecation or packaging warnings)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel built from a copy of the tree, and what the build printed (pip -q: warnings and errors only)."""
    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("source")  # setuptools writes build/ into the tree it builds: use a copy
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("hypic_rag", "training", "evals"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    completed = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    if completed.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {completed.stderr.strip().splitlines()[-1:]}")
    return next(out.glob("hypic_rag-*.whl")), completed.stdout + completed.stderr


@pytest.fixture(scope="module")
def wheel(wheel_build: tuple[Path, str]) -> Path:
    return wheel_build[0]


def test_the_build_prints_no_warnings(wheel_build: tuple[Path, str]) -> None:
    """setuptools warned about a TOML-table license and about asset folders missing from `packages` (issue 31)."""
    output = wheel_build[1]
    assert not [line for line in output.splitlines() if "warning" in line.lower() or "deprecat" in line.lower()], output


def test_wheel_holds_the_product_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_levels = {name.split("/")[0] for name in names if not name.startswith("hypic_rag-")}
    assert top_levels == {"hypic_rag"}, top_levels
    assert "hypic_rag/kernels/gated_delta_rule.py" in names
    assert {"hypic_rag/runtime/ops/registry.py", "hypic_rag/runtime/ops/gated_delta_rule/chunk.py"} <= set(names)
    for asset in ("default_model/model.safetensors", "default_model/tokenizer.json", "default_model/config.json",
                  "default_model/MODEL_CARD.md", "example_corpus/questions.jsonl",
                  "example_corpus/documents/s777000000-person-8.md"):
        assert f"hypic_rag/demo/assets/{asset}" in names, asset
    shipped = {path.relative_to(ROOT).as_posix() for path in (ROOT / "hypic_rag" / "demo" / "assets").rglob("*") if path.is_file()}
    assert shipped <= set(names), sorted(shipped - set(names))  # every asset file is installed
    page = {path.relative_to(ROOT).as_posix() for path in (ROOT / "hypic_rag/server/static").iterdir()}
    assert {"hypic_rag/server/static/index.html", "hypic_rag/server/static/page.js"} <= page <= set(names), page
    assert not [name for name in names if "/training/" in name or "synthetic_qa" in name or "/data/" in name]


def test_every_source_package_is_listed_for_the_wheel() -> None:
    """pyproject lists packages explicitly (and the data packages with them): a new subpackage, or a new folder of bundled
    data under hypic_rag/demo/assets (a data package), must be added there."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "hypic_rag").rglob("__init__.py")
    }
    assets = ROOT / "hypic_rag" / "demo" / "assets"
    data_packages = {".".join(path.relative_to(ROOT).parts) for path in [assets, *assets.rglob("*")]
                     if path.is_dir() and path.name != "__pycache__"} | {"hypic_rag.server.static"}
    assert on_disk | data_packages == listed


def test_kernels_import_name_is_not_ours() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", "import importlib.util, hypic_rag.kernels as k; "
         "s = importlib.util.find_spec('kernels'); print(k.__name__, s and s.origin)"],
        capture_output=True, text=True, cwd="/", timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    name, origin = completed.stdout.split()
    assert name == "hypic_rag.kernels"
    assert origin == "None" or "site-packages" in origin, origin  # the distribution, never our source


def test_the_repository_root_does_not_shadow_the_kernels_distribution() -> None:
    """Run from the repository root (the root on sys.path, as `python -m ...` and pytest's `pythonpath` put it), the
    name `kernels` reaches the `kernels` distribution transformers >= 5.25 imports at start-up, never our code: the
    kernels are `hypic_rag/kernels/`, and the root holds no `kernels` folder. Without that distribution the name does
    not import at all."""
    assert not (ROOT / "kernels").exists()
    script = (
        "import importlib.util\n"
        "from transformers.models.jamba import modeling_jamba\n"
        "import hypic_rag.kernels as ours\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec and spec.origin, ours.__file__)\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    origin, ours = completed.stdout.split()
    assert ours == str(ROOT / "hypic_rag" / "kernels" / "__init__.py")
    assert origin == "None" or "site-packages" in origin, origin  # the distribution, never our source


def test_the_set_up_constraints_satisfy_the_package_ranges() -> None:
    """`make setup` installs with `-c constraints.txt`: every dependency the package declares (extras included) is
    pinned there at a version its range in pyproject.toml allows, so the tested set is one users can get."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pinned = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pinned[canonicalize_name(name)] = version.strip()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(text) for text in project["dependencies"]]
    declared += [Requirement(text) for extra in ("test", "llamaindex", "bench")
                 for text in project["optional-dependencies"][extra]]
    outside = [f"{requirement} (pinned {pinned.get(canonicalize_name(requirement.name))})"
               for requirement in declared if canonicalize_name(requirement.name) != "torch"
               and pinned.get(canonicalize_name(requirement.name)) not in requirement.specifier]
    assert outside == []
