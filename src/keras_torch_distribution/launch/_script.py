"""The script `ktd run` is given, checked before anything starts: a file
that is there and compiles. Each rank would otherwise fail on it, seconds
later and once per rank; Python's own message for a syntax error is shown
once, in well under a second. `Refused` is how `ktd run` stops before any
rank starts: one message, exit 2 (a usage error), or 1 for a script that
does not compile (as `python script.py` exits).
"""

import os
import traceback


class Refused(SystemExit):
    """An argument, setting or script refused before any rank starts:
    `ktd` prints `message` and exits with `code` (2: a usage error)."""

    def __init__(self, message, code=2):
        super().__init__(code)
        self.message = message

    def __str__(self):
        return self.message


_EXAMPLE = "e.g. `ktd run -n 2 train.py`"


def check_script(script):
    """Refuse a script that is not a file, or that does not compile."""
    where = os.path.abspath(script)
    if os.path.isdir(script):
        inside = os.path.join(script, "__main__.py")
        hint = (
            f" (its {inside} is what `python {script}` would run: give that)"
            if os.path.isfile(inside)
            else ""
        )
        raise Refused(
            f"ktd run: {script!r} is a directory, not a script{hint}: give "
            f"the path of a Python file, {_EXAMPLE}."
        )
    if not os.path.isfile(script):
        raise Refused(
            f"ktd run: no script {script!r} (looked for {where}): give the "
            f"path of a Python file, {_EXAMPLE}."
        )
    try:
        with open(script, "rb") as file:
            source = file.read()
    except OSError as error:
        raise Refused(
            f"ktd run: cannot read {script!r}: {error.strerror}. Give a script "
            "this user can read."
        ) from None
    try:
        compile(source, script, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as error:  # ValueError: a null byte
        said = "".join(traceback.format_exception_only(type(error), error))
        raise Refused(
            f"{said.rstrip()}\nktd run: {script} does not compile (above); "
            "no process was started. Fix that line, then run it again.",
            code=1,
        ) from None
