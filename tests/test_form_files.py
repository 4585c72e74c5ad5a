"""What a new layer form costs, counted (issue 33: "a new layer form is at most three files; ARCHITECTURE.md
says which, and a test counts what it can").

A layer form's name (a `traits.LayerForm`) may appear only in its own file under planner/families/forms/,
in planner/families/traits.py (the Literal and the traits derived from the form) and in the family records
(planner/families/registry.py): those are the three files of a new form. Any other module naming a form
is a place a new form would have to be added by hand; the one left is listed here, with why, so the count
in ARCHITECTURE.md ("Where to add things") is this test's.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from planner.families.traits import LayerForm

ROOT = Path(__file__).resolve().parent.parent / "planner"
THE_THREE = {"planner/families/traits.py", "planner/families/registry.py"}  # + the form's own file
# Modules outside the three that still name a form, each a file a new form must also edit, and why. None
# since planner/models/params.py reads the layer form's ops (its registration order from the form's own
# `@layer_form(..., norms_registered_last=...)`); perf/flops.py and the activations' weight casts read them
# too (planner.families.forms.block_matmuls).
STILL_NAMING_A_FORM: set[str] = set()


def _modules_naming_a_form() -> set[str]:
    forms = set(get_args(LayerForm))
    out = set()
    for path in ROOT.rglob("*.py"):
        rel = str(path.relative_to(ROOT.parent))
        if rel.startswith("planner/families/forms/"):
            continue
        consts = {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)}
        if consts & forms:
            out.add(rel)
    return out


def test_a_new_layer_form_is_its_file_traits_and_a_record_plus_what_is_listed():
    assert _modules_naming_a_form() == THE_THREE | STILL_NAMING_A_FORM
    assert len(THE_THREE) + 1 + len(STILL_NAMING_A_FORM) <= 3


def test_each_form_file_names_only_its_own_form():
    forms = set(get_args(LayerForm))
    for path in (ROOT / "families" / "forms").glob("*.py"):
        consts = {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)}
        named = consts & forms
        assert named <= {path.stem}, (path.name, named)


def test_the_count_can_fail():
    """A module that names a form is found (the scan is not vacuous)."""
    assert "planner/families/traits.py" in _modules_naming_a_form()
