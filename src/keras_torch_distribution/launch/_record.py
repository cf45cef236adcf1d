"""What a failing rank leaves for its launcher: its exception, recorded in
torch's error file (TORCHELASTIC_ERROR_FILE, as torch's `record` writes it)
with two more fields the launcher prints from (`_processes.failures`):

- `ktd_traceback`: the traceback without the frames of the launcher, the
  patch table and the package (as Keras filters its own frames), so that
  the user's line is the last one above the error;
- `ktd_time`: when it failed, in seconds to the microsecond (torch keeps
  whole seconds, too coarse to tell which rank failed first);
- `ktd_exitcode`: the exit code it is about to exit with. torchrun stops
  the other ranks as soon as one has exited, and a rank stopped while it
  was still exiting (its atexit hooks, the process group's teardown) shows
  torchrun's SIGTERM instead: the launcher says the code the rank chose.

A rank that ends by `sys.exit(N)` (N not 0) records the code and the line
that exited (`record_exit`: `ktd_exitcode`, `ktd_exit_at`), no traceback.

The rank then exits 1 without printing its traceback: the launcher prints
the first failure once. It prints it itself where nobody else will: with
no error file (a bare `python -m keras_torch_distribution.launch`), with
KTD_FULL_TRACEBACKS=1 (every rank's whole traceback, as before), or when
torchrun will restart the ranks (--max-restarts) and report nothing.
"""

import json
import os
import sys
import sysconfig
import time
import traceback

from keras_torch_distribution import _env

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Frames never shown in a short traceback: the launcher's (runpy, torch's
# elastic agent), Python's own library's (contextlib's, ...) and, while
# Keras filters tracebacks, Keras' own.
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_LAUNCHER_PARTS = (
    "<frozen ",
    os.path.join("torch", "distributed", "elastic") + os.sep,
    os.sep + os.path.join("keras_torch_distribution_cli", ""),  # `ktd`
)
_KERAS_PARTS = (os.path.join("keras", "src") + os.sep,)


def _keras_filters():
    keras = sys.modules.get("keras")
    try:
        return bool(keras.config.is_traceback_filtering_enabled())
    except AttributeError:  # Keras not imported (yet)
        return True


def _hidden(filename, keras_too):
    if filename.startswith(_PACKAGE_DIR + os.sep):
        return True
    if filename.startswith(_STDLIB_DIR) and "site-packages" not in filename:
        return True
    if any(part in filename for part in _LAUNCHER_PARTS):
        return True
    return keras_too and any(part in filename for part in _KERAS_PARTS)


def short_traceback(error):
    """`error`'s traceback (its causes' too) without the launcher's, the
    patch table's, the package's and the standard library's frames, and
    Keras' while Keras filters tracebacks; where that leaves no frame, the
    innermost is kept."""
    keras_too = _keras_filters()
    formatted = traceback.TracebackException.from_exception(error)
    seen = set()
    link = formatted
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        frames = [f for f in link.stack if not _hidden(f.filename, keras_too)]
        if not frames and len(link.stack):
            frames = [link.stack[-1]]
        link.stack = traceback.StackSummary.from_list(frames)
        link = link.__cause__ or link.__context__
    return "".join(formatted.format())


def _full_tracebacks():
    try:
        return _env.full_tracebacks()
    except ValueError:  # refused by `ktd run` before the ranks start
        return False


def _restarts_left(environ):
    """True when torchrun will start the ranks again after this failure."""
    done = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    most = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not (done.isdigit() and most.isdigit()):
        return False
    return int(done) < int(most)


def record_failure(error, exit_code, environ=os.environ):
    """Record `error` for the launcher, with the `exit_code` this process
    then exits with, and print it here where the launcher will not."""
    path = environ.get("TORCHELASTIC_ERROR_FILE")
    short = short_traceback(error)
    if path:
        full = "".join(
            traceback.format_exception(type(error), error, error.__traceback__)
        )
        data = {
            "message": {
                "message": f"{type(error).__name__}: {error}",
                "extraInfo": {
                    "py_callstack": full,
                    "timestamp": str(int(time.time())),
                    "ktd_traceback": short,
                    "ktd_time": time.time(),
                    "ktd_exitcode": exit_code,
                },
            }
        }
        with open(path, "w") as file:
            json.dump(data, file)
    if _full_tracebacks():
        traceback.print_exception(type(error), error, error.__traceback__)
    elif not path or _restarts_left(environ):
        rank = environ.get("RANK", "?")
        print(f"[ktd rank {rank}] {short}", end="", file=sys.stderr)


def exit_code_of(stop):
    """The exit status a `SystemExit` gives the process (Python's rule: an
    int as it is, None 0, anything else 1 after printing it)."""
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else 1


def record_exit(stop, environ=os.environ):
    """Record for the launcher that this process ends by `sys.exit` with a
    code that is not 0: the code and the line that called it (the
    innermost frame outside the launcher, the package and the standard
    library)."""
    path = environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    keras_too = _keras_filters()
    frames = traceback.extract_tb(stop.__traceback__)
    shown = [f for f in frames if not _hidden(f.filename, keras_too)]
    where = (shown or frames or [None])[-1]
    data = {
        "message": {
            "message": f"SystemExit: {stop.code}",
            "extraInfo": {
                "timestamp": str(int(time.time())),
                "ktd_time": time.time(),
                "ktd_exitcode": exit_code_of(stop),
                "ktd_exit_at": f"{where.filename}:{where.lineno}"
                if where is not None
                else None,
            },
        }
    }
    with open(path, "w") as file:
        json.dump(data, file)
