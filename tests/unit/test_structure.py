"""The package's structure: layers without an import circle, one seam.

LAYERS lists the package's layers bottom first: its top-level modules and
its sub-packages. Inside a sub-package the order is the one its
`__init__` docstring lists its modules in ("- `name`: ..."), and the
package's `__init__` sits above its modules. A module imports only modules
below it (at module level or inside functions), so there is no import
circle. `docs/architecture.md`'s layer table lists LAYERS, checked here.
Only the `_keras` package (the seam) imports `keras.src`.
"""

import ast
import os
import re

import pytest

import keras_torch_distribution

PACKAGE_DIR = os.path.dirname(keras_torch_distribution.__file__)
PACKAGE = "keras_torch_distribution"
ARCHITECTURE = os.path.join(
    os.path.dirname(__file__), "..", "..", "docs", "architecture.md"
)

LAYERS = [
    "_op_counts",  # counting dispatched ops: torch only (tests, benchmarks)
    "_keras",  # the seam: the only importer of keras.src (a package)
    "_env",  # KTD_* settings
    "_log",
    "_processes",  # this process joins its job: launchers, process group
    "_distributed",  # meshes, DTensors
    "_fsdp",
    "_variables",  # born sharded
    "_backend",  # the torch backend as Keras calls it (distribution_lib)
    "_saving",
    "_batch",
    "checkpoint",
    "_preemption",  # signals: an agreed step, its backup, the exit
    "_training",  # the step
    "_report",
    "callbacks",  # public Keras callbacks (Throughput)
    "_patches",  # the patch table
    "_install",  # install / uninstall, the exit hook
    "__init__",
    "plan",  # ktd plan: a simulated world of N on one CPU
    "launch",  # ktd run; what each launched process runs
    "cli",
    "__main__",
    "testing",
]


def package_order(package_dir, package):
    """The modules of a sub-package in the order its `__init__` docstring
    lists them ("- `name`: ..."), bottom first."""
    path = os.path.join(package_dir, package, "__init__.py")
    docstring = ast.get_docstring(
        ast.parse(open(path, encoding="utf-8").read())
    )
    return re.findall(r"^- `(\w+)`", docstring or "", flags=re.M)


def positions(package_dir, layers):
    """Module name -> a sortable position: (layer, place in its package)."""
    where = {}
    for module, path in _modules(package_dir).items():
        package, _, name = module.partition(".")
        is_package = module != "__init__" and path.endswith("__init__.py")
        if module in layers and not is_package:
            where[module] = (layers.index(module), 0)
            continue
        if package not in layers:
            continue
        order = package_order(package_dir, package)
        if is_package:  # the package's __init__, above its modules
            where[module] = (layers.index(package), len(order))
        elif name in order:
            where[module] = (layers.index(package), order.index(name))
    return where


def _modules(package_dir):
    """Module name (relative to the package; a package's __init__ by the
    package's name) -> source file."""
    found = {}
    for directory, _, files in os.walk(package_dir):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            parts = os.path.relpath(path, package_dir)[: -len(".py")].split(
                os.sep
            )
            if parts[-1] == "__init__" and len(parts) > 1:
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _package_imports(module, path, known):
    """The package modules `module` imports, resolved to names of `known`."""
    imported = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            names = []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = [] if module == "__init__" else module.split(".")
                if not path.endswith("__init__.py"):
                    parts = parts[:-1]  # a module's package
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([PACKAGE] + parts + ([base] if base else []))
            targets = [base]
            names = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            inner = target[len(PACKAGE) + 1 :]
            submodules = [f"{inner}.{n}".strip(".") for n in names]
            resolved = [m for m in submodules if m in known]
            if resolved:
                imported.update(resolved)
            elif inner:
                imported.add(inner)
            else:
                imported.add("__init__")
    imported.discard(module)
    return imported


def _keras_src_importers(package_dir):
    offenders = []
    for module, path in sorted(_modules(package_dir).items()):
        if module == "_keras" or module.startswith("_keras."):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
                if node.module == "keras":
                    names += [f"keras.{a.name}" for a in node.names]
            if any(
                n == "keras.src" or n.startswith("keras.src.") for n in names
            ):
                offenders.append(module)
                break
    return offenders


def layer_violations(package_dir, layers):
    """(module, imported module) pairs where a module imports one that is
    not below it; modules LAYERS and their package's docstring miss are
    named too."""
    modules = _modules(package_dir)
    where = positions(package_dir, layers)
    unlisted = sorted(set(modules) - set(where))
    violations = []
    for module in sorted(where):
        for imported in sorted(
            _package_imports(module, modules[module], modules)
        ):
            if where.get(imported, (len(layers), 0)) >= where[module]:
                violations.append((module, imported))
    return unlisted, violations


def test_every_module_imports_only_layers_below_it():
    unlisted, violations = layer_violations(PACKAGE_DIR, LAYERS)
    assert unlisted == [], (
        f"add {unlisted} to LAYERS in {__file__}, or to its package's "
        "__init__ docstring's module list"
    )
    assert violations == [], (
        "these imports go up (or sideways) in the layer order, which allows "
        f"import circles: {violations}"
    )


def test_only_the_seam_imports_keras_src():
    offenders = _keras_src_importers(PACKAGE_DIR)
    assert offenders == [], (
        f"{offenders} import keras.src; only the _keras package may reach "
        "Keras internals. Add an accessor to _keras/ and use it."
    )


def architecture_layers(path):
    """The first column of the layer table in docs/architecture.md: the
    backticked names of each row, in order (a row may name several)."""
    text = open(path, encoding="utf-8").read()
    table = text.split("<!-- layers -->")[1]
    names = []
    rows = table.strip().split("\n\n")[0].splitlines()
    for row in rows[2:]:  # after the header and its rule
        first = row.split("|")[1]
        names += re.findall(r"`([\w.]+)/?`", first)
    return names


def test_the_architecture_doc_lists_the_layers_in_order():
    assert architecture_layers(ARCHITECTURE) == LAYERS


@pytest.fixture
def fake_package(tmp_path):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_keras.py").write_text("from keras.src import backend\n")
    (package / "low.py").write_text("import keras\n")
    (package / "high.py").write_text(
        f"from {PACKAGE} import low\n\n"
        "def f():\n"
        f"    from {PACKAGE} import top\n"
    )
    (package / "top.py").write_text(
        f"from {PACKAGE} import high\nfrom keras import src\n"
    )
    (package / "sub" / "__init__.py").write_text(
        '"""Sub.\n\n- `leaf`: a leaf.\n"""\nfrom . import leaf\n'
    )
    (package / "sub" / "leaf.py").write_text(
        "from keras.src.utils import rng_utils\n"
    )
    return str(package)


def test_the_checks_find_offenders(fake_package):
    layers = ["_keras", "low", "high", "top", "sub", "__init__"]
    assert layer_violations(fake_package, layers) == ([], [("high", "top")])
    assert layer_violations(fake_package, layers[:-1]) == (
        ["__init__"],
        [("high", "top")],
    )
    assert _keras_src_importers(fake_package) == ["sub.leaf", "top"]


def test_a_package_orders_its_modules_by_its_docstring(fake_package):
    sub = os.path.join(fake_package, "sub")
    with open(os.path.join(sub, "__init__.py"), "w") as f:
        f.write(
            '"""Sub.\n\n'
            "- `leaf`: a leaf.\n"
            "- `stem`: above it.\n"
            '"""\n'
            "from . import leaf\n"
        )
    with open(os.path.join(sub, "stem.py"), "w") as f:
        f.write("from keras_torch_distribution.sub import leaf\n")
    with open(os.path.join(sub, "leaf.py"), "w") as f:
        f.write("from keras_torch_distribution.sub import stem\n")
    layers = ["_keras", "low", "high", "top", "sub", "__init__"]
    assert package_order(fake_package, "sub") == ["leaf", "stem"]
    assert layer_violations(fake_package, layers) == (
        [],
        [("high", "top"), ("sub.leaf", "sub.stem")],
    )


def _keras_private_names():
    """Private attribute names of the Keras objects the package handles
    (variables, layers, models, optimizers, callbacks), from live objects."""
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    objects = [
        model,
        model.layers[0],
        model.layers[0].kernel,
        model.optimizer,
        keras.random.SeedGenerator(1),
        keras.callbacks.BackupAndRestore("unused"),
        keras.callbacks.CSVLogger("unused.csv"),
        keras.callbacks.ModelCheckpoint("unused.keras"),
        keras.callbacks.CallbackList([]),
    ]
    names = set()
    for obj in objects:
        for name in list(vars(obj)) + dir(type(obj)):
            if (
                name.startswith("_")
                and not name.startswith("__")
                and not name.startswith("_ktd_")
            ):
                names.add(name)
    return names


def private_keras_reads(package_dir, private_names):
    """(module, attribute) where a module other than `_keras` reads or
    writes a private attribute of a Keras object (by name: `x._name` with
    `_name` one of Keras' private names), `self._name` aside."""
    found = []
    for module, path in sorted(_modules(package_dir).items()):
        if module == "_keras" or module.startswith("_keras."):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private_names
                and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self"
                )
            ):
                found.append((module, node.attr))
    return sorted(set(found))


def test_only_the_seam_reads_private_attributes_of_keras_objects():
    offenders = private_keras_reads(PACKAGE_DIR, _keras_private_names())
    assert offenders == [], (
        f"{offenders} reach into private attributes of Keras objects; only "
        "the _keras package may. Add an accessor to _keras/ and use it."
    )


def test_the_private_attribute_check_finds_offenders(tmp_path):
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "_keras.py").write_text("def raw(v):\n    return v._value\n")
    (package / "user.py").write_text(
        "def f(variable, callback):\n"
        "    variable._value = 1\n"
        "    return callback._current_epoch\n"
    )
    (package / "own.py").write_text(
        "class A:\n    def f(self):\n        return self._value\n"
    )
    names = {"_value", "_current_epoch"}
    assert private_keras_reads(str(package), names) == [
        ("user", "_current_epoch"),
        ("user", "_value"),
    ]


def _replacement_first_lines():
    """(patched attribute, first docstring line of its replacement) for
    every entry of the patch table that wraps a Keras original (and of the
    rows for libraries on Keras installed here)."""
    import functools
    import importlib

    from keras_torch_distribution import _patches

    table = _patches._patch_table()
    for name, rows in _patches.after_import().items():
        try:
            table += rows(importlib.import_module(name))
        except ImportError:  # a library on Keras not installed here
            continue
    found = []
    for patch in table:
        if not patch.wrap:
            continue
        replacement = patch.replacement
        while isinstance(replacement, functools.partial):
            replacement = replacement.func
        doc = (replacement.__doc__ or "").strip()
        found.append((patch.describe(), doc.split("\n\n")[0]))
    return found


def test_every_replacement_opens_with_the_keras_attribute_it_replaces():
    """The patch table is the audit list: each replacement's docstring
    opens by naming, in backticks, the Keras (or, for the one torch row,
    torch) attribute it replaces."""
    offenders = []
    for target, first in _replacement_first_lines():
        name = target.rsplit(".", 1)[-1]
        named = re.search(rf"`[\w.' ]*\b{re.escape(name)}\b[^`]*`", first)
        if not ("Keras" in first or "torch" in first) or not named:
            offenders.append((target, first[:70]))
    assert offenders == [], (
        "open these replacements' docstrings with the Keras attribute "
        f"they replace, e.g. 'Keras `Owner.name`: ...': {offenders}"
    )
