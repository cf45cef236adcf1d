"""Preemption: a signal during a multi-process `fit` ends it on every rank
at one agreed step, with a backup written there, and the process exits
with 128 + the signal; the next start resumes at that step.

Modules, bottom first (a module imports only those above it):

- `signals`: the handler that only takes note of a signal, the watchdog,
  and `Preempted`.
- `requeue`: `scontrol requeue` of a SLURM job.
- `agreed_stop`: `PreemptTogether`, the last callback of such a `fit`: the
  ranks agree on the step, write their backups there, and exit
  (`PreemptEvaluation`: the same for `evaluate`, with nothing to save).

Nothing is re-exported but `Preempted` (importing the package imports
them all).
"""

from keras_torch_distribution._preemption.signals import Preempted

__all__ = ["Preempted"]
