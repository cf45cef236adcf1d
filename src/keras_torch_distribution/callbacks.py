"""Keras callbacks for distributed training: `Throughput`, given to `fit`
as `callbacks=[Throughput(flops_per_sample=...)]`, adds samples/s,
tokens/s, step_ms, peak_mem_MiB (and, on several processes, the worst
rank, peak_mem_rank) and MFU to the progress line, each with the digits
it needs, e.g. `20/20 - 2s 98ms/step - loss: 0.5200 - samples/s: 651 -
tokens/s: 83354 - step_ms: 98.3 - peak_mem_MiB: 812 - peak_mem_rank: 1 -
MFU: 0.41`.
"""

from __future__ import annotations

import resource
import sys
import time

import keras
import torch
import torch.distributed as dist

from keras_torch_distribution._batch import adapter
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._log import warn_once
from keras_torch_distribution._processes import runtime

# Dense bf16 peak FLOP/s of one device, by a word of torch's device name
# (vendors' data sheets); `peak_flops` overrides.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}
# How often the progress figures read this rank's peak memory (seconds).
MEMORY_EVERY = 1.0


def peak_memory_bytes():
    """This process's peak memory: CUDA's most allocated where training
    runs on CUDA, else the process's peak resident set (getrusage). Reads
    a host counter: no device sync."""
    if runtime.uses_cuda() and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def device_peak_flops():
    """The dense bf16 peak FLOP/s of this process's CUDA device from
    PEAK_FLOPS, or None (CPU, or a device not listed)."""
    if not (runtime.uses_cuda() and torch.cuda.is_available()):
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def token_count(x):
    """Elements of the token-id tensor among the inputs `x` (the
    "token_ids" entry of a dict, else the first integer tensor), or None
    where no input is integer."""
    if isinstance(x, dict) and "token_ids" in x:
        leaves = [x["token_ids"]]
    else:
        leaves = keras.tree.flatten(x)
    for leaf in leaves:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        dtype = keras.backend.standardize_dtype(dtype)
        if "int" in dtype:
            return int(leaf.numel() if hasattr(leaf, "numel") else leaf.size)
    return None


class Figure(float):
    """A figure of the progress line: a float everywhere (history,
    CSVLogger, arithmetic), shown by Keras' progress bar with the digits
    it needs ("651", "98.3", "0.41", a rank "1"), not Keras' four decimals
    ("0.0000e+00" for rank 0), which made lines of 165 to 230 characters
    that wrapped at every update."""

    def __new__(cls, value, whole=False):
        figure = super().__new__(cls, value)
        figure.whole = whole
        return figure

    def __truediv__(self, other):  # Keras' progress bar averages: x / 1
        return Figure(float(self) / other, self.whole)

    def __format__(self, spec):
        value = float(self)
        if self.whole or abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _rows(x):
    """Rows of this process's batch `x` (its first leaf's leading dim)."""
    first = keras.tree.flatten(x)[0]
    return int(first.shape[0])


class Throughput(keras.callbacks.Callback):
    """Speed and memory in `fit`'s progress output (rank 0 prints it).

    Adds to the logs: `samples/s` (global batch, all replicas), `tokens/s`
    (where an input holds integer token ids: its elements, all replicas),
    `step_ms` (wall time per step), `peak_mem_MiB` (while the epoch runs,
    this rank's peak; at its end the worst rank's, named by
    `peak_mem_rank` on several processes) and `MFU` on CUDA where
    `flops_per_sample` is given
    (its training FLOPs per sample, e.g. 6 x parameters x sequence length
    for a transformer, over the devices' peak: `peak_flops` per device, or
    PEAK_FLOPS by the device's name). Figures come from host clocks and
    counters: no device sync per step; the ranks' peaks are gathered once,
    at the epoch's end. As Keras' `ms/step`, the rates leave out each
    epoch's first step (which compiles and warms up) when the epoch has
    more. `epochs` keeps each epoch's figures.

    Collective (at each epoch's end): give it to `fit` on every rank.
    """

    def __init__(self, flops_per_sample=None, peak_flops=None):
        super().__init__()
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        self.epochs = []  # one dict per epoch: see `figures`
        self._original = None

    def on_train_begin(self, logs=None):
        model = self.model
        self._original = model.train_function

        def counted(data):
            self._saw(data)
            return self._original(data)

        model.train_function = counted
        if runtime.uses_cuda() and self.mfu(1.0) is None:
            warn_once(
                ("throughput-mfu",),
                "Throughput: MFU unknown: %s.",
                "give flops_per_sample (training FLOPs per sample)"
                if not self.flops_per_sample
                else "this GPU's peak is not in callbacks.PEAK_FLOPS: give "
                "peak_flops (dense FLOP/s of one device)",
            )

    def on_train_end(self, logs=None):
        if self._original is not None:
            self.model.train_function = self._original
            self._original = None

    def _saw(self, data):
        """Count one batch's global rows and tokens (host ints only)."""
        batch = data[0] if isinstance(data, (list, tuple)) else data
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        rows = _rows(x)
        placed = adapter.batch_rows()  # (global rows, first, rows) or None
        replica_count = replicas.current().count
        global_rows = placed[0] if placed else rows * replica_count
        self._samples += global_rows
        tokens = token_count(x)
        if tokens is not None:
            self._tokens = (self._tokens or 0) + tokens * global_rows // rows

    def on_epoch_begin(self, epoch, logs=None):
        self._samples, self._tokens, self._steps = 0, None, 0
        self._started = self._memory_read = None
        self._first = None  # (end, samples, tokens) of the epoch's first step
        self._peak = 0

    def on_train_batch_begin(self, batch, logs=None):
        if self._started is None:
            self._started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        now = time.perf_counter()
        self._ended = now
        if self._first is None:
            self._first = (now, self._samples, self._tokens)
        if self._memory_read is None or now - self._memory_read > MEMORY_EVERY:
            self._memory_read = now
            self._peak = peak_memory_bytes()
        if logs is not None:
            logs.update(self.figures(self._peak, runtime.process_id()))

    def timed(self):
        """(seconds, steps, samples, tokens) the rates are taken over: the
        epoch so far after its first step, or the first step alone."""
        if self._steps > 1:
            first_end, first_samples, first_tokens = self._first
            tokens = (
                None
                if self._tokens is None
                else self._tokens - (first_tokens or 0)
            )
            return (
                self._ended - first_end,
                self._steps - 1,
                self._samples - first_samples,
                tokens,
            )
        return self._ended - self._started, 1, self._samples, self._tokens

    def figures(self, peak_bytes, peak_rank):
        """The figures of the epoch so far (`Figure`s): samples/s, tokens/s
        (where counted), step_ms, peak_mem_MiB (of `peak_rank`, named on
        several processes), MFU (where known)."""
        seconds, steps, samples, tokens = self.timed()
        seconds = max(seconds, 1e-9)
        result = {"samples/s": Figure(samples / seconds)}
        if tokens is not None:
            result["tokens/s"] = Figure(tokens / seconds)
        result["step_ms"] = Figure(1000 * seconds / steps)
        result["peak_mem_MiB"] = Figure(peak_bytes / 2**20, whole=True)
        if runtime.is_multi_process():
            result["peak_mem_rank"] = Figure(peak_rank, whole=True)
        mfu = self.mfu(result["samples/s"])
        if mfu is not None:
            result["MFU"] = Figure(mfu)
        return result

    def mfu(self, samples_per_second):
        """The model FLOPs utilisation, or None where unknown (no
        `flops_per_sample`, or no peak for this device: CPU, or a GPU
        not in PEAK_FLOPS without `peak_flops`)."""
        peak = self.peak_flops or device_peak_flops()
        if not self.flops_per_sample or not peak:
            return None
        devices = runtime.num_processes()
        return self.flops_per_sample * samples_per_second / (peak * devices)

    def on_epoch_end(self, epoch, logs=None):
        if self._started is None:
            return
        peaks = [peak_memory_bytes()]
        if runtime.is_multi_process():
            peaks = [None] * runtime.num_processes()
            dist.all_gather_object(
                peaks, peak_memory_bytes(), group=runtime.cpu_group()
            )
        worst = max(range(len(peaks)), key=lambda r: (peaks[r], -r))
        figures = self.figures(peaks[worst], worst)
        seconds, steps, samples, tokens = self.timed()
        self.epochs.append(
            dict(
                figures,
                epoch=epoch,
                peak_mem_rank=worst,
                seconds=self._ended - self._started,
                steps=self._steps,
                samples=self._samples,
                tokens=self._tokens,
                timed=dict(
                    seconds=seconds, steps=steps, samples=samples, tokens=tokens
                ),
                peak_bytes=peaks,
                mfu_known=self.mfu(figures["samples/s"]) is not None,
            )
        )
        if logs is not None:
            logs.update(figures)
