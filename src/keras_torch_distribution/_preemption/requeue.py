"""SLURM requeue after a preemption: `scontrol requeue` on the job.

With `#SBATCH --signal=USR1@90` SLURM sends SIGUSR1 90 s before the time
limit; with `--requeue` a requeued job starts again from its batch script
(and resumes from the backup). KTD_SLURM_REQUEUE: "auto" (default)
requeues after SIGUSR1 when SLURM_JOB_ID is set, "1" after any preemption
signal under SLURM, "0" never. Rank 0 runs it once, after every rank's
backup is complete.
"""

from __future__ import annotations

import os
import signal
import subprocess

from keras_torch_distribution import _env

# How long `scontrol` may take before the requeue is given up.
SCONTROL_TIMEOUT_SECONDS = 30


def job_to_requeue(signal_number: int, environ=None) -> str | None:
    """The SLURM job id to requeue after `signal_number`, or None."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    choice = _env.slurm_requeue()
    if not job or choice == "0":
        return None
    if choice == "auto" and signal_number != signal.SIGUSR1:
        return None
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    array_task = environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return job


def requeue(job: str) -> str:
    """Run `scontrol requeue JOB`; what happened, in words (a failure is
    reported, not raised: the backup is written either way)."""
    command = ["scontrol", "requeue", job]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return (
            f"the requeue failed ({' '.join(command)}: {error}); requeue the "
            "job by hand (scontrol requeue) or submit it again"
        )
    if done.returncode != 0:
        output = (done.stderr or done.stdout).strip()
        return (
            f"the requeue failed ({' '.join(command)} exited with "
            f"{done.returncode}: {output}); requeue the job by hand or "
            "submit it again"
        )
    return f"SLURM job {job} requeued"
