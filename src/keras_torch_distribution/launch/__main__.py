"""What each process of a launch runs: `python -m
keras_torch_distribution.launch SCRIPT [ARGS]` (or `-m MODULE [ARGS]`),
and, loaded without the package's `__init__`, `ktd run`'s ranks
(`keras_torch_distribution_cli._rank`).

The backend is installed into Keras as soon as the script imports Keras
(so an unchanged Keras script runs on torch; a script that never imports
Keras starts as fast as under torchrun), a failing process records its
exception where the launcher reads it (`_record`: the launcher prints the
first failure once, for the whole job), and a process whose launcher dies
(even by SIGKILL) is killed with it rather than left running.

Imports neither Keras nor the package's front at module level: the
package is imported when Keras is.
"""

import atexit
import ctypes
import importlib.abc
import importlib.util
import os
import runpy
import signal
import sys

from keras_torch_distribution._processes.record import PARENT_PID_VARIABLE
from keras_torch_distribution.launch._record import exit_code_of
from keras_torch_distribution.launch._record import record_exit
from keras_torch_distribution.launch._record import record_failure

USAGE = (
    "usage: python -m keras_torch_distribution.launch SCRIPT [ARGS] | -m "
    "MODULE [ARGS]"
)
_PACKAGE = "keras_torch_distribution"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(environ=os.environ):
    """On Linux, have the kernel SIGKILL this process when the launcher that
    started it exits (prctl PR_SET_PDEATHSIG), and exit now if it already
    has. Does nothing elsewhere or without KTD_PARENT_PID."""
    parent = environ.get(PARENT_PID_VARIABLE, "")
    if not sys.platform.startswith("linux") or not parent.isdigit():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(parent):  # it died before the prctl took effect
        raise SystemExit(
            f"the launcher (pid {parent}) that started this process is gone"
        )


class LostHostsError(RuntimeError):
    """A collective failed because hosts of the job were lost: the message
    names them and their ranks (`_processes.lost_hosts`)."""


def _package_ready():
    """Once Keras is imported: the package imported (which installs the
    backend into Keras) and other libraries' logging quieted on the other
    ranks (`_log.quiet_other_ranks`)."""
    import keras_torch_distribution  # noqa: F401
    from keras_torch_distribution._log import quiet_other_ranks

    quiet_other_ranks()  # other libraries' logging: rank 0's, once


class _AfterKeras(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import hook: `import keras` (the script's, or a library's) runs
    Keras' own module, then `_package_ready()`. Once."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        self._keras_loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._keras_loader.create_module(spec)

    def exec_module(self, module):
        self._keras_loader.exec_module(module)
        _package_ready()


def install_with_keras():
    """Install the backend into Keras when the script imports Keras (now,
    if Keras is already imported)."""
    if "keras" in sys.modules:
        _package_ready()
    elif not any(isinstance(f, _AfterKeras) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterKeras())


def run_target(argv):
    """Run a script file or `-m MODULE` as __main__, the backend installed
    into Keras when it imports Keras; a failure that lost hosts is raised
    again as a `LostHostsError` naming them (the line `ktd run` shows)."""
    try:
        _run(argv)
    except Exception as error:
        if _PACKAGE not in sys.modules:  # no collective of the package ran
            raise
        from keras_torch_distribution._processes import lost_hosts

        line = lost_hosts.explain(error)
        if line is None:
            raise
        raise LostHostsError(line) from error


def _run(argv):
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(USAGE)
    install_with_keras()
    if argv[0] == "-m":
        module = argv[1]
        sys.argv = [module] + list(argv[2:])  # run_module puts the file first
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def end_together():
    """The script ended (returned, or `sys.exit(0)`): agree with the other
    ranks that they ended too (`agreement.end_of_script`), where the script
    used the package. A rank still in a collective call the others skipped
    (`if rank == 0: model.save(...)`) raises there, naming the call; this
    one, which did nothing wrong, then exits at once with 0 (its exit hooks
    run; the interpreter's teardown, seconds long, is skipped: the launcher
    would stop it meanwhile, as if it had failed too)."""
    if _PACKAGE not in sys.modules:  # no process group of the package
        return
    from keras_torch_distribution._distributed import agreement

    if not agreement.end_of_script():
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main(argv):
    """Run the target; a failure is recorded for the launcher, which
    prints it once for the job (`_record`), and Ctrl-C ends the rank
    quietly with 130 (the launcher says so in one line)."""
    import faulthandler

    faulthandler.enable(all_threads=True)  # as torch's `record`
    try:
        try:
            run_target(argv)
        except SystemExit as stop:
            if exit_code_of(stop) != 0:
                record_exit(stop)  # the code, and the line: said once
                raise
        end_together()
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)
    except Exception as error:
        record_failure(error, exit_code=1)
        sys.exit(1)


if __name__ == "__main__":
    die_with_parent()
    main(sys.argv[1:])
