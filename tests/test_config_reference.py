"""docs/configuration.md is what `ucm.tools.config_reference` generates from the schemas."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ByteSize, Field

ROOT = Path(__file__).resolve().parents[1]

# Loaded from this checkout's tools/ (shipped as ucm.tools): an editable install of another
# checkout would map ucm.tools to that one's.
_spec = importlib.util.spec_from_file_location("_config_reference",
                                               ROOT / "tools" / "config_reference.py")
reference = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)


def test_committed_reference_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    code = reference.main(["--check", str(ROOT / "docs" / "configuration.md")])
    assert code == 0, capsys.readouterr().err


def test_check_names_the_command_when_stale(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(reference.render().replace("| `promote` |", "| `promoted` |"))
    assert reference.main(["--check", str(stale)]) == 1
    assert capsys.readouterr().err == (
        f"{stale} is out of date: run python -m ucm.tools.config_reference > "
        "docs/configuration.md\n")
    assert reference.main(["--check", str(tmp_path / "missing.md")]) == 1


def test_every_option_of_every_builtin_driver_has_a_row() -> None:
    from ucm.drivers._registry import _BUILTIN, get_driver_class

    text = reference.render()
    for name in _BUILTIN:
        assert f"## Driver `{name}`" in text
        section = text.split(f"## Driver `{name}`", 1)[1].split("\n## ", 1)[0]
        rows = [line for line in section.splitlines() if line.startswith("| `tiers[].")]
        assert [r.split("`")[1] for r in rows] == [
            f"tiers[].{field}" for field in get_driver_class(name).Options.model_fields]


class _Inner(BaseModel):
    depth: int = Field(default=2, ge=0, le=4, description="levels")


class _Sample(BaseModel):
    mode: Literal["a", "b"] = Field(default="a", description="which | one")
    size: ByteSize = Field(default=ByteSize(2 * 2**30), ge=2**20, description="room")
    read_timeout: float = Field(default=1.5, gt=0, description="wait")
    ratio: float = 0.5  # a plain comment
    inner: list[_Inner] = Field(default_factory=list, description="parts")
    path: str = Field(description="where <root> is")


def test_a_section_renders_types_defaults_bounds_and_nested_keys() -> None:
    text = reference.render([reference.Section("Sample", _Sample, "x.", "About it.")])
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `x.mode` | one of a\\|b | `a` | which \\| one |",
        "| `x.size` | bytes (e.g. 2GiB), >= 1MiB | 2GiB | room |",
        "| `x.read_timeout` | float seconds, > 0 | 1.5 | wait |",
        "| `x.ratio` | float | 0.5 | a plain comment |",
        "| `x.inner` | list of mapping | [] | parts |",
        "| `x.inner[].depth` | int, >= 0, <= 4 | 2 | levels |",
        "| `x.path` | string | required | where &lt;root> is |",
    ]
    assert "## Sample\n\nAbout it.\n" in text
