"""The launcher: `ktd run`, and what every process it starts runs.

`python -m keras_torch_distribution.launch SCRIPT [ARGS]` runs one process
of a launch (`__main__`); `ktd run -n N SCRIPT` starts N of them over
torchrun (`_torchrun`). Which launcher started a process, and how it joins
its job, is `_processes`' (below every other layer); this package sits at
the top, beside `cli` and `plan`, and `import keras_torch_distribution`
does not load it.

Modules, bottom first (a module imports only those above it):

- `_record`: a failing rank records its exception (and a traceback
  without the launcher's frames) for the launcher, which prints it once.
- `_stuck_agent`: a node whose torchrun agent cannot reach the rendezvous
  store ends anyway, with the failed rank's error.
- `_torchrun`: `ktd run`, over torchrun.
- `__main__`: what every launched process runs (`python -m
  keras_torch_distribution.launch SCRIPT`).

Nothing is re-exported: importing the package imports none of them.
"""
