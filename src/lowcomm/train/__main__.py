"""``python -m lowcomm.train CONFIG_JSON [--failure-dir DIR]``: one worker process of a job that
:func:`lowcomm.train.launcher.launch_processes` started (:func:`lowcomm.train.worker.main`).
Users start jobs with ``lowcomm train``; this is the command the launcher runs for them."""

from lowcomm.procs.forkserver import exit_now
from lowcomm.train.worker import main

if __name__ == "__main__":
    exit_now(main())
