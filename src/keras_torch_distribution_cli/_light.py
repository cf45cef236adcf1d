"""keras_torch_distribution's launcher modules, imported without the
package's `__init__`.

`import keras_torch_distribution` imports Keras and installs the backend
into it (5 s and more, and an error under another KERAS_BACKEND): right for
a training script, wrong for `ktd run`, which only checks a script and
starts torchrun, and for the first moments of each rank it starts, before
the script has imported anything. The modules those need (`launch`, and
`_env`, `_processes`' failure report, ...) import neither Keras nor the
package's front; inside `package_without_keras()` they import as usual,
under a bare parent package that stands in for the real one.
"""

import contextlib
import importlib.machinery
import importlib.util
import sys

PACKAGE = "keras_torch_distribution"


@contextlib.contextmanager
def package_without_keras():
    """Inside this block, `import keras_torch_distribution.X` imports X
    (and what X imports) without running the package's `__init__`. On
    leaving it, every module imported so is taken out of `sys.modules`
    again (the objects imported stay usable): a later `import
    keras_torch_distribution` imports the real package, whole. Where the
    package is already imported (a test's process), it is used as it is.
    """
    if PACKAGE in sys.modules:
        yield
        return
    found = importlib.util.find_spec(PACKAGE)  # finds it; imports nothing
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{PACKAGE} is not installed in this Python ({sys.executable}): "
            "install it, e.g. `pip install keras-torch-distribution`.",
            name=PACKAGE,
        )
    spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
    spec.submodule_search_locations = list(found.submodule_search_locations)
    stand_in = importlib.util.module_from_spec(spec)
    stand_in.__doc__ = "A stand-in: see keras_torch_distribution_cli._light"
    sys.modules[PACKAGE] = stand_in
    try:
        yield
    finally:
        for name in [n for n in sys.modules if _in_package(n)]:
            del sys.modules[name]


def _in_package(name):
    return name == PACKAGE or name.startswith(PACKAGE + ".")
