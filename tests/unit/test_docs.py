"""Docs the tests keep true: docs/architecture.md's patch tables against
the code's (`_patches`' patch table and the planner's scoped patches),
both ways; the README's length and its `ktd plan`."""

import importlib
import os
import re
import types

import pytest
import torch.distributed as dist

from keras_torch_distribution import _keras
from keras_torch_distribution import _patches
from keras_torch_distribution._distributed import masked_lookup
from keras_torch_distribution.plan import _fake_step
from keras_torch_distribution.plan import _peers
from keras_torch_distribution.plan import _stops

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")
README = os.path.join(ROOT, "README.md")
# The owner the doc names for the planner's patch of the script's model's
# class (`_fake_step._model_calls`: `type(model).__call__`).
MODEL_CLASS = "type(model)"


def path_of(owner):
    """A patched owner's full dotted path: a module's name, a class's
    module and qualified name."""
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    return f"{owner.__module__}.{owner.__qualname__}"


def install_patches():
    """(owner path, attribute) of every row `_install` can apply: the
    patch table, the fast ops, and the rows that turn off Keras 3.16's own
    distribution (as on a Keras that has them, whatever this one is)."""
    native = types.SimpleNamespace(
        **{
            **vars(_keras),
            "NATIVE_TORCH_TRAINING": True,
            "NATIVE_VARIABLE_DISTRIBUTION": True,
        }
    )
    patches = (
        _patches._patch_table()
        + _patches._fast_ops(_keras)
        + _patches._native_distribution_off(native)
    )
    return {(path_of(p.owner), p.name) for p in patches}


def after_import_patches():
    """(owner path, attribute) of the rows applied when a library on Keras
    imports its module (`_patches.after_import`), for the libraries
    installed here (imported to read their owners); and the top-level
    names of the libraries that are not."""
    found, absent = set(), set()
    for name, rows in _patches.after_import().items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            absent.add(name.split(".")[0])
            continue
        found |= {(path_of(p.owner), p.name) for p in rows(module)}
    return found, absent


def planner_patches():
    """(owner path, attribute) of what `ktd plan` replaces for one block."""
    found = {(path_of(_keras.Model), name) for name in _stops.STOPPED_AT}
    found |= {
        (dist.__name__, name)
        for name in _peers.NEEDS_PEERS + tuple(_peers.ROOTED)
    }
    found |= {(path_of(o), name) for o, name in _fake_step._INDEX_MATH}
    assert callable(_fake_step._model_calls)
    found.add((MODEL_CLASS, "__call__"))
    return found


def doc_patches(path):
    """(owner path, attribute) of every row of the tables between
    `<!-- patches -->` and `<!-- /patches -->`: each backticked owner of the
    first column (under `keras.src` unless it starts with `torch` or
    `keras_hub` or is the model's class) with each backticked attribute of
    the second."""
    text = open(path, encoding="utf-8").read()
    region = text.split("<!-- patches -->")[1].split("<!-- /patches -->")[0]
    found = set()
    for line in region.splitlines():
        cells = line.split("|")[1:-1]
        if len(cells) < 2 or set(cells[0].strip()) <= {"-", " "}:
            continue
        owners = re.findall(r"`([^`]+)`", cells[0])
        names = re.findall(r"`([^`]+)`", cells[1])
        for owner in owners:
            if not (
                owner.startswith(("torch", "keras_hub")) or owner == MODEL_CLASS
            ):
                owner = "keras.src." + owner
            found |= {(owner, name) for name in names}
    return found


def test_the_patch_tables_of_the_architecture_doc_match_the_code():
    if _keras.torch_core.__name__ != "keras.src.backend.torch.core":
        # Keras 3.16 moved the torch backend's ops and classes (31 of the
        # owners' paths differ); the doc names Keras 3.15's paths, and CI
        # checks it on 3.15.
        pytest.skip("the doc's owner paths are Keras 3.15's")
    after, absent = after_import_patches()
    code = install_patches() | planner_patches() | after
    doc = doc_patches(ARCHITECTURE)
    # A library not installed here: its rows cannot be read from the code.
    doc = {(o, n) for o, n in doc if o.split(".")[0] not in absent}
    if masked_lookup.MaskBuffer is None:  # a torch without it: no such row
        doc = {(o, n) for o, n in doc if not o.endswith(".MaskBuffer")}
    assert sorted(code - doc) == [], (
        "these attributes are replaced but docs/architecture.md's patch "
        "tables do not name them: add a row (owner path under keras.src, "
        "attribute, replacement, what for)"
    )
    assert sorted(doc - code) == [], (
        "docs/architecture.md's patch tables name these, but nothing "
        "replaces them: fix or remove the rows"
    )


def test_the_doc_table_reader_finds_rows_and_misses(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "| a | b |\n| --- | --- |\n| `x.Y` | `z` |\n"
        "<!-- patches -->\n\n| owner | attributes | by |\n| --- | --- | --- |\n"
        "| `backend`, `torch.distributed` | `f`, `g` | `_mine` |\n"
        "| `type(model)` (its class) | `__call__` | `plan` |\n"
        "| `keras_hub.x.Loader` | `f` | `_saving` |\n"
        "<!-- /patches -->\n"
    )
    assert doc_patches(str(doc)) == {
        ("keras.src.backend", "f"),
        ("keras.src.backend", "g"),
        ("torch.distributed", "f"),
        ("torch.distributed", "g"),
        (MODEL_CLASS, "__call__"),
        ("keras_hub.x.Loader", "f"),
    }


def test_the_readme_is_short_and_names_ktd_plan():
    lines = open(README, encoding="utf-8").read().splitlines()
    assert len(lines) <= 250, (
        f"README.md has {len(lines)} lines; keep it to 250 (move detail "
        "into docs/)"
    )
    text = "\n".join(lines)
    assert "ktd plan" in text, "README.md must show `ktd plan`"
    assert "docs/plan.md" in text, "README.md must link docs/plan.md"


def test_the_readme_says_what_the_tests_cost_and_what_torchrun_needs():
    """Issue 48: the test command's cost, and that a plain torchrun runs
    only scripts that set the backend and import the package (`ktd run`
    runs unchanged ones)."""
    text = " ".join(open(README, encoding="utf-8").read().split())
    assert "about half an hour on 2 CPU cores" in text
    assert (
        "`torchrun --nproc-per-node 2 train.py` runs scripts that, as this "
        "one, set KERAS_BACKEND=torch and import the package." in text
    )
