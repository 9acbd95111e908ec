"""Cooperate with submitit on preemption.

submitit installs a handler for its preemption signal (USR2) that checkpoints the submitted callable and requeues
the job. forge-train installs its own handler over it (forge.resilience.preemption), so the signal only sets a flag;
the trainer finishes the step, writes its checkpoint and returns. Then this module calls submitit's handler, which
requeues the job with the same arguments: the requeued job lands in the same run directory and
`checkpoint.resume=auto` picks the checkpoint up. The number of requeues is bounded by submitit's
`max_num_timeout` (every signal counts against it when `timeout_min` < 10, see submitit's SignalHandler).
"""

import logging
import os
import signal

log = logging.getLogger("forge")


def requeue_via_submitit() -> bool:
    """Requeue this submitit SLURM job through submitit's own handler; False outside such a job.

    On global rank 0 this does not return: submitit requeues the job and exits. Other ranks return True and leave the
    requeue to rank 0. Raises submitit's UncompletedJobError when no requeue is left (max_num_timeout spent).
    """
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return False
    from submitit.core.job_environment import JobEnvironment, SignalHandler

    signum = JobEnvironment._usr_sig()
    handler = signal.getsignal(signum)
    if not isinstance(getattr(handler, "__self__", None), SignalHandler):
        log.warning("submitit's preemption handler is not installed; exiting without a requeue")
        return False
    log.warning("preempted under submitit: requeueing the job; it resumes from the checkpoint just written")
    handler(signum, None)
    return True
