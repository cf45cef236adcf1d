"""What ranks agree on: that they do the same thing, when they stop, and
that a step succeeded on every rank.

Each rank runs its own copy of Keras' program, and every collective must be
met by every rank. Here, the three ways ranks agree before they go on:

- `compare`: ranks that run different programs (a rank-dependent LayoutMap
  or model, per-process inputs of different lengths, other batch sizes or
  epochs) used to end in a gloo "collective mismatch" abort or, worse,
  train silently on inconsistent rows. Every rank describes what must
  match as (name, text) pairs, and the ranks compare a digest of it in one
  all-gather of a few bytes. Only when digests differ is the description
  gathered, and every rank raises the same `RanksDisagreeError` naming the
  first difference and the ranks on each side. `_training.call_agreement`
  describes a fit / evaluate / predict call this way; the same all-gather
  starts the broadcast that makes a build's copies equal
  (`_variables.copies`), with what is being done in it: a rank that builds
  a model the others do not build meets their fit / evaluate / predict, or
  their build of another model, and every rank raises an error naming what
  each side was doing, instead of waiting forever in a broadcast.
- Stopping together: when one rank stops training or runs out of data,
  every rank stops at the same step. A callback that sets
  `model.stop_training` on one rank only (a wall-clock limit, a custom
  early stop) or per-process inputs of unknown length that end at
  different steps used to leave one rank in a collective the others had
  left. `StopTogether`, the last callback of `fit` on several processes,
  agrees on `model.stop_training` after every batch and every epoch, where
  Keras' loop reads it: one all-reduce of one integer per rank (the flag,
  and what a subclass adds: `preemption` sends the signal a rank
  received). When some ranks set it, every rank stops there (as one
  process would have) and says which ranks stopped. `ends_together(batches)`
  yields a batch only when every rank has one: per-process inputs of
  unknown length (Python generators, iterable datasets) end on every rank
  at the step where the first one ended, and every rank says which ranks
  ran out.
- Collective steps (`barrier`, `agree`, `gather`): every rank runs a step;
  if it raised on any rank, every rank raises (the first failing rank's
  error), so that no rank goes on into a collective the others left
  (checkpoints' files, preemption's backups).

Everything here travels in CPU tensors or objects on `runtime.cpu_group()`
(gloo also where NCCL carries the training collectives, and where the
application started an NCCL-only group).
"""

import hashlib
import pickle

import keras
import torch
import torch.distributed as dist

from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._log import warn_on_every_rank
from keras_torch_distribution._processes import lost_hosts
from keras_torch_distribution._processes import runtime


class RanksDisagreeError(RuntimeError):
    """Ranks called fit / evaluate / predict with different programs."""


def compare(doing, items, data=None):
    """Raise RanksDisagreeError on every rank when ranks are doing other
    things (`doing`: "fit()", "the build of ...") or describe it with other
    `items` ((name, text) pairs); return every rank's (doing's kind, items'
    digest, `data` (a 16-hex-digit digest or None), replica index), as
    integers. One all-gather of 32 bytes (a CPU tensor, on
    `runtime.cpu_group()`), and one more of the descriptions when they
    differ. Collective: call on every rank."""
    digest = hashlib.sha256(repr(items).encode()).hexdigest()[:16]
    header = torch.tensor(
        [
            _code(_kind(doing)),
            _code(digest),
            _code(data),
            replicas.current().index,
        ],
        dtype=torch.int64,
    )
    group = runtime.cpu_group()
    gathered = [
        torch.empty_like(header) for _ in range(runtime.num_processes())
    ]
    dist.all_gather(gathered, header, group=group)
    gathered = [tuple(int(v) for v in entry) for entry in gathered]
    if len({entry[:2] for entry in gathered}) == 1:
        return gathered
    everyone = [None] * runtime.num_processes()
    dist.all_gather_object(everyone, (doing, dict(items)), group=group)
    if len({_kind(d) for d, _ in everyone}) > 1:
        raise RanksDisagreeError(_different_programs([d for d, _ in everyone]))
    raise RanksDisagreeError(
        first_difference([i for _, i in everyone], _kind(doing))
    )


def _code(text):
    """A text (or a hex digest) as a signed 64-bit integer; None as 0."""
    if text is None:
        return 0
    value = int(hashlib.sha256(text.encode()).hexdigest()[:16], 16)
    return value - (1 << 64) if value >= (1 << 63) else value


def _kind(doing):
    """What kind of thing `doing` is: "fit()" is itself, "the build of 2
    variables (...)" is "the build"."""
    return doing.split(" of ", 1)[0]


def _sides(values):
    """Ranks grouped by their value: "ranks [0]: a; ranks [1, 2]: b"."""
    groups = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return "; ".join(
        f"ranks {ranks}: {value}" for value, ranks in groups.items()
    )


# What a rank that reached the end of its script is doing: it meets, in
# `end_of_script`, a rank still in a collective call (a rank-0-only save).
END_OF_SCRIPT = "the end of the script"


def end_of_script():
    """Agree that every rank reached the end of its script. A rank still in
    a collective call the others skipped (`if rank == 0: model.save(...)`)
    then raises RanksDisagreeError there, at the user's line, naming the
    call and the fix, instead of waiting for peers that are gone; the ranks
    that ended return False (they did nothing wrong: the error is said
    once, by the others). The launcher's processes call it when their
    script returns. Collective: call on every rank."""
    if not (runtime.is_initialized() and runtime.is_multi_process()):
        return True
    try:
        compare(END_OF_SCRIPT, [])
    except RanksDisagreeError:
        return False
    except RuntimeError as error:  # (torch's DistBackendError among them)
        if not lost_hosts.is_lost_peer(error):
            raise
        # A rank that ended without agreeing (os._exit, or a failure the
        # launcher reports): nothing is left to agree with.
    return True


def _did(doing):
    """What a rank was doing, as said in a sentence."""
    if doing == END_OF_SCRIPT:
        return f"reached {doing}"
    if doing.endswith("()"):
        return f"called {doing}"
    return f"were in {doing}"


def _different_programs(doings):
    groups = {}
    for rank, doing in enumerate(doings):
        groups.setdefault(doing, []).append(rank)
    said = "; ".join(
        f"ranks {ranks} {_did(doing)}" for doing, ranks in groups.items()
    )
    calls = [doing for doing in groups if doing.endswith("()")]
    if calls and all(
        doing.endswith("()") or doing == END_OF_SCRIPT for doing in groups
    ):
        named = " and ".join(calls)
        return (
            f"Ranks are running different programs: {said}. {named} "
            f"{'is' if len(calls) == 1 else 'are'} collective (every rank "
            "takes part; for a file, rank 0 writes it): call "
            f"{'it' if len(calls) == 1 else 'each'} on every rank, in the "
            "same order, not under `if rank == 0`."
        )
    return (
        f"Ranks are running different programs: {said}. Under a "
        "distribution, every rank must build the same models in the same order "
        "and call fit / evaluate / predict together (building a model on some "
        "ranks only makes a collective that the others never join). Make the "
        "differing step the same on every rank, or build a model meant for one "
        "rank only outside the distribution (before "
        "keras.distribution.set_distribution, or after set_distribution(None))."
    )


def first_difference(descriptions, doing):
    """The message for the first item on which ranks' descriptions of
    `doing` ("fit()", "the build") differ."""
    names = []
    for description in descriptions:
        names += [n for n in description if n not in names]
    for name in names:
        values = [d.get(name, "<absent>") for d in descriptions]
        if len(set(values)) == 1:
            continue
        return (
            f"{doing} differs between ranks in {name}: {_sides(values)}. Every "
            "rank must run the same program on the same distribution, model "
            "and input sizes (per-process inputs with auto_shard_dataset=False "
            "must have the same number of rows on every rank). Make the "
            "differing value the same on every rank."
        )
    return f"{doing} differs between ranks, but no single item shows how."


# ---------------------------------------------------------------------------
# Ranks that stop together.
# ---------------------------------------------------------------------------


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
        self._agree(f"{self.epoch_text(self._epoch)}, after batch {batch + 1}")

    def on_epoch_end(self, epoch, logs=None):
        self._agree(f"the end of {self.epoch_text(epoch)}")

    def epoch_text(self, epoch):
        """Epoch `epoch` (counted from 0) as Keras' progress bar shows it:
        "Epoch 2/6"."""
        epochs = (self.params or {}).get("epochs")
        return f"Epoch {epoch + 1}" + (f"/{epochs}" if epochs else "")

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


# ---------------------------------------------------------------------------
# Collective steps: a step run on every rank, failed on every rank if it
# failed on any.
# ---------------------------------------------------------------------------


def barrier(group=None):
    """Every rank waits for the others, on `group` (default: the group for
    CPU tensors, `runtime.cpu_group()`, which needs no current GPU).
    Collective: call on every rank."""
    if runtime.is_multi_process():
        dist.barrier(group=group or runtime.cpu_group())


def agree(step, group=None):
    """Run `step()` on every rank; if it raised on any rank, raise on every
    rank (the first failing rank's error), so that no rank goes on into a
    collective the others left. Returns this rank's result.
    Collective: call on every rank."""
    results = []
    gather(lambda: results.append(step()), group)
    return results[0]


def gather(step, group=None):
    """Every rank's result of `step()` (a list indexed by rank); if it
    raised on any rank, the first failing rank's error is raised on every
    rank. Collective: call on every rank."""
    result, error = None, None
    try:
        result = step()
    except Exception as caught:  # re-raised below, on every rank
        error = caught
    mine = (result, _portable(error))
    everyone = [mine]
    if runtime.is_multi_process():
        group = group or runtime.cpu_group()
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    first = next((e for _, e in everyone if e is not None), None)
    if error is not None:
        raise error
    if first is not None:
        raise first
    return [theirs for theirs, _ in everyone]


class RankFailedError(RuntimeError):
    """A step failed on a rank with an error that cannot cross processes
    (it does not survive pickling): the error's type and text, and `rank`,
    the rank it was raised on."""

    def __init__(self, message, rank=None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank))


def _portable(error):
    """`error` if it survives pickling, else a RankFailedError with its
    text (what another rank can raise)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # an exception type that cannot cross processes
        return RankFailedError(
            f"on rank {runtime.process_id()}: {type(error).__name__}: {error}",
            runtime.process_id(),
        )
    return error
