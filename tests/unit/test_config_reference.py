"""docs/configuration.md is generated from the settings' declarations and kept current."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from pgq.settings import Settings

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "config_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_has_a_docstring_and_a_row():
    gen = _generator()
    docs = gen.field_docs()
    names = [f.name for f in dataclasses.fields(Settings)]
    assert sorted(docs) == sorted(names)
    page = gen.render()
    for name in names:
        assert f"`{name}`" in page


def test_the_page_is_current():
    """Run `python scripts/config_reference.py` after changing a setting."""
    gen = _generator()
    assert gen.PAGE.read_text(encoding="utf-8") == gen.render()
