"""Ranks stop together: when one rank stops training or runs out of data,
every rank stops at the same step.

Each rank runs its own copy of Keras' training loop, and every step is a
collective. A callback that sets `model.stop_training` on one rank only (a
wall-clock limit, a custom early stop) or per-process inputs of unknown
length that end at different steps used to leave one rank in a collective
the others had left: a gloo "collective mismatch" abort. Here:

- `StopTogether`, the last callback of `fit` on several processes, agrees
  on `model.stop_training` after every batch and every epoch, where Keras'
  loop reads it: one all-reduce of one integer per rank (the flag, and
  what a subclass adds: `preemption` sends the signal a rank received).
  When some ranks set it, every rank stops there (as one process would
  have) and says which ranks stopped.
- `ends_together(batches)` yields a batch only when every rank has one:
  per-process inputs of unknown length (Python generators, iterable
  datasets) end on every rank at the step where the first one ended, and
  every rank says which ranks ran out.

The flags travel in a CPU tensor on `runtime.cpu_group()` (gloo also where
NCCL carries the training collectives, and where the application started
an NCCL-only group).
"""

import keras
import torch
import torch.distributed as dist

from keras_torch_distribution.distributed import runtime
from keras_torch_distribution.log import warn_on_every_rank


def codes_of_ranks(code):
    """Every rank's integer `code`, in rank order, as every rank sees it.
    One all-reduce of one int32 per rank. Collective: call on every rank."""
    codes = torch.zeros(runtime.num_processes(), dtype=torch.int32)
    codes[runtime.process_id()] = int(code)
    dist.all_reduce(codes, group=runtime.cpu_group())
    return codes.tolist()


def ranks_with_flag(flag):
    """The ranks whose `flag` is true, as every rank sees it. Collective:
    call on every rank."""
    codes = codes_of_ranks(bool(flag))
    return [rank for rank, value in enumerate(codes) if value]


class StopTogether(keras.callbacks.Callback):
    """Agrees on `model.stop_training` across ranks after every batch and
    every epoch of `fit`. Must be the last callback (it reads what the
    others set). Collective: every rank runs it at the same points."""

    reads_batch_logs = False  # so no host read of the logs for it

    def __init__(self):
        super().__init__()
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._agree(f"epoch {self._epoch}, after batch {batch}")

    def on_epoch_end(self, epoch, logs=None):
        self._agree(f"the end of epoch {epoch}")

    def _agree(self, where):
        codes = codes_of_ranks(
            int(bool(self.model.stop_training)) | self.own_code() << 1
        )
        stopping = [rank for rank, code in enumerate(codes) if code & 1]
        if stopping and len(stopping) < runtime.num_processes():
            warn_on_every_rank(
                "model.stop_training was set on rank(s) %s only (by a "
                "callback, e.g. EarlyStopping or a time limit, or by your "
                "code), at %s: every rank stops training here, as one process "
                "would. Set it on every rank to keep this message away.",
                stopping,
                where,
            )
        if stopping:
            self.model.stop_training = True
        self.agreed([code >> 1 for code in codes], where)

    def own_code(self):
        """What else this rank tells the others at each agreement, as a
        non-negative integer (in the same all-reduce)."""
        return 0

    def agreed(self, codes, where):
        """Every rank's `own_code()` at this agreement, in rank order."""
        del codes, where


def ends_together(batches):
    """`batches` (an iterator of per-process batches of unknown number)
    while every rank has a batch; the iteration ends on every rank at the
    first batch some rank lacks. Collective per batch: call on every rank."""
    position = 0
    while True:
        batch = next(batches, _NONE)
        missing = ranks_with_flag(batch is _NONE)
        if missing:
            if len(missing) < runtime.num_processes():
                warn_on_every_rank(
                    (
                        "Rank(s) %s ran out of input after %d batches while "
                        "other ranks had more: every rank ends this pass over "
                        "the data there, and the others' remaining batches are "
                        "not used. Give every process the same number of "
                        "batches (per-process inputs are each process's part "
                        "of every global batch)."
                    ),
                    missing,
                    position,
                )
            return
        position += 1
        yield batch


_NONE = object()
