"""The package's structure: layers without an import circle, one seam.

LAYERS lists the package's modules bottom first; a module imports only
modules listed before it (at module level or inside functions), so there
is no import circle. Only `_keras.py` imports `keras.src`.
"""

import ast
import os

import pytest

import keras_torch_distribution

PACKAGE_DIR = os.path.dirname(keras_torch_distribution.__file__)
PACKAGE = "keras_torch_distribution"

LAYERS = [
    "_keras",  # the only importer of keras.src
    "_env",  # KTD_* settings
    "log",
    "launch.hostlist",  # the launch side: detection and process start (pure of Keras)
    "launch.variables",
    "launch.schedulers",
    "launch.environments",
    "launch.failures",
    "launch.spawn",
    "launch.torchrun",  # `ktd run`
    "launch",
    "seeds",  # every process agrees on seeds (runtime seeds a new group)
    "runtime",
    "sharding_rules",  # DTensor rules; what torch's own can and cannot do
    "layouts",
    "tensors",
    "collectives",  # the one bucketed flat collective
    "stopping",  # ranks stop together
    "flat_shards",  # FSDP's flat all-gather / reduce-scatter of a group's shards
    "lookup_gradients",  # an embedding's gradient made in rank-major order
    "collective_counts",  # counting a step's collectives (tests, benchmarks)
    "replicas",
    "agreement",  # ranks agree (fit / evaluate / predict, and each build)
    "copies",  # copies of a variable made equal from creation
    "distribution_lib",
    "sharded_init",
    "fsdp",
    "einsum_grad",  # einsum that saves its operands (FSDP regathers them)
    "variables",
    "whole_variables",  # what a layout map leaves whole
    "fsdp_groups",  # FSDP by group, prefetched
    "data",
    "random_slices",
    "sync_batch_norm",
    "gradients",
    "overlap",
    "optimizer_update",
    "boundary",
    "compiled",
    "saving",
    "metric_states",  # metric states summed, in the gradient all-reduce when it can
    "trainer",
    "replica_start",
    "checkpoint._errors",
    "checkpoint._keys",
    "checkpoint._files",
    "checkpoint._dcp",
    "checkpoint.callbacks",
    "checkpoint.inspect",
    "checkpoint",
    "report",
    "_install",  # the patch table
    "__init__",
    "launch.__main__",  # what each launched process runs
    "cli",
    "__main__",
    "testing",
]


def _modules(package_dir):
    """Module name (relative to the package; a package's __init__ by the
    package's name) -> source file."""
    found = {}
    for directory, _, files in os.walk(package_dir):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            parts = os.path.relpath(path, package_dir)[: -len(".py")].split(os.sep)
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
        if module == "_keras":
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
                if node.module == "keras":
                    names += [f"keras.{a.name}" for a in node.names]
            if any(n == "keras.src" or n.startswith("keras.src.") for n in names):
                offenders.append(module)
                break
    return offenders


def layer_violations(package_dir, layers):
    """(module, imported module) pairs where a module imports one that is
    not listed before it; modules missing from `layers` are named too."""
    modules = _modules(package_dir)
    unlisted = sorted(set(modules) - set(layers))
    position = {name: index for index, name in enumerate(layers)}
    violations = []
    for module in sorted(set(modules) & set(layers)):
        for imported in sorted(_package_imports(module, modules[module], modules)):
            if position.get(imported, len(layers)) >= position[module]:
                violations.append((module, imported))
    return unlisted, violations


def test_every_module_imports_only_layers_below_it():
    unlisted, violations = layer_violations(PACKAGE_DIR, LAYERS)
    assert unlisted == [], f"add {unlisted} to LAYERS in {__file__}"
    assert violations == [], (
        "these imports go up (or sideways) in the layer order, which allows "
        f"import circles: {violations}"
    )


def test_only_the_seam_imports_keras_src():
    offenders = _keras_src_importers(PACKAGE_DIR)
    assert offenders == [], (
        f"{offenders} import keras.src; only _keras.py may reach Keras "
        "internals. Add an accessor to _keras.py and use it."
    )


@pytest.fixture
def fake_package(tmp_path):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_keras.py").write_text("from keras.src import backend\n")
    (package / "low.py").write_text("import keras\n")
    (package / "high.py").write_text(
        f"from {PACKAGE} import low\n\ndef f():\n    from {PACKAGE} import top\n"
    )
    (package / "top.py").write_text(f"from {PACKAGE} import high\nfrom keras import src\n")
    (package / "sub" / "__init__.py").write_text("from . import leaf\n")
    (package / "sub" / "leaf.py").write_text("from keras.src.utils import rng_utils\n")
    return str(package)


def test_the_checks_find_offenders(fake_package):
    layers = ["_keras", "low", "high", "top", "sub.leaf", "sub", "__init__"]
    assert layer_violations(fake_package, layers) == ([], [("high", "top")])
    assert layer_violations(fake_package, layers[:-1]) == (["__init__"], [("high", "top")])
    assert _keras_src_importers(fake_package) == ["sub.leaf", "top"]


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
            if name.startswith("_") and not name.startswith("__") and not name.startswith("_ktd_"):
                names.add(name)
    return names


def private_keras_reads(package_dir, private_names):
    """(module, attribute) where a module other than `_keras` reads or
    writes a private attribute of a Keras object (by name: `x._name` with
    `_name` one of Keras' private names), `self._name` aside."""
    found = []
    for module, path in sorted(_modules(package_dir).items()):
        if module == "_keras":
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private_names
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
            ):
                found.append((module, node.attr))
    return sorted(set(found))


def test_only_the_seam_reads_private_attributes_of_keras_objects():
    offenders = private_keras_reads(PACKAGE_DIR, _keras_private_names())
    assert offenders == [], (
        f"{offenders} reach into private attributes of Keras objects; only "
        "_keras.py may. Add an accessor to _keras.py and use it."
    )


def test_the_private_attribute_check_finds_offenders(tmp_path):
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "_keras.py").write_text("def raw(v):\n    return v._value\n")
    (package / "user.py").write_text(
        "def f(variable, callback):\n    variable._value = 1\n    return callback._current_epoch\n"
    )
    (package / "own.py").write_text("class A:\n    def f(self):\n        return self._value\n")
    names = {"_value", "_current_epoch"}
    assert private_keras_reads(str(package), names) == [
        ("user", "_current_epoch"),
        ("user", "_value"),
    ]
