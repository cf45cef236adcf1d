"""The launcher: `ktd run`, and what every process it starts runs.

`python -m keras_torch_distribution.launch SCRIPT [ARGS]` runs one process
of a launch (`__main__`); `ktd run -n N SCRIPT` starts N of them over
torchrun (`_torchrun`). Which launcher started a process, and how it joins
its job, is `_processes`' (below every other layer); this package sits at
the top, beside `cli` and `plan`, and `import keras_torch_distribution`
does not load it.

None of these modules imports Keras or the package's front: the `ktd`
command (`keras_torch_distribution_cli`) loads them without the package's
`__init__` (`keras_torch_distribution_cli._light`), so `ktd run` answers a
missing script or a syntax error in well under a second under any
KERAS_BACKEND, and a rank imports Keras (and installs the backend into it)
when its script does.

Modules, bottom first (a module imports only those above it):

- `_record`: a failing rank records its exception (and a traceback
  without the launcher's frames) for the launcher, which prints it once.
- `_script`: the script checked before anything starts (a file that
  compiles); `Refused`, how `ktd run` stops before any rank starts.
- `_stuck_agent`: a node whose torchrun agent cannot reach the rendezvous
  store ends anyway, with the failed rank's error.
- `_torchrun`: `ktd run`, over torchrun.
- `__main__`: what every launched process runs (`python -m
  keras_torch_distribution.launch SCRIPT`, and `ktd run`'s ranks).

Nothing is re-exported: importing the package imports none of them.
"""
