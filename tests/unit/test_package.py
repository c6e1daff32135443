"""The installed package: ``patchswarm`` and its four layers, the public API and the console script."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import patchswarm

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_resolves_to_where_the_table_says() -> None:
    assert patchswarm.__all__ == sorted(patchswarm._EXPORTS)
    for name, module in patchswarm._EXPORTS.items():
        value = getattr(patchswarm, name)
        assert value is getattr(importlib.import_module(module), name)
        assert getattr(value, "__module__", module) == module, f"{name} is defined in {value.__module__}, not {module}"


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        _ = patchswarm.NoSuchThing  # type: ignore[attr-defined]
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("patchswarm.NoSuchThing resolved")


def test_importing_the_package_loads_no_layer_and_no_torch() -> None:
    """Every ``patchswarm.<layer>`` import imports ``patchswarm`` first: it must cost nothing."""
    code = "import sys, patchswarm; print(sorted(m for m in sys.modules if m.startswith(('torch', 'patchswarm.'))))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout == "[]\n"


def test_the_layers_import_under_the_package_name_from_the_folders() -> None:
    for layer in ("protocol", "swarm", "daemon", "simulations"):
        module = importlib.import_module(f"patchswarm.{layer}")
        assert [Path(p).resolve() for p in module.__path__] == [(ROOT / layer).resolve()]


def test_the_console_script_is_the_cli() -> None:
    [script] = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "patchswarm"]
    assert script.value == "patchswarm.daemon.cli:main"


def test_the_architecture_page_lists_every_module_once() -> None:
    """docs/architecture.md has one line per module under its layer's heading: a new module gets its line."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    for layer in ("protocol", "swarm", "daemon", "simulations"):
        section = page.split(f"### {layer}/\n", 1)[1].split("\n### ", 1)[0]
        listed = re.findall(r"^- `(\w+\.py)`", section, re.M)
        modules = sorted(p.name for p in (ROOT / layer).glob("*.py") if p.name != "__init__.py")
        assert sorted(listed) == modules, layer
