"""``python -m lowcomm.train CONFIG_JSON [--failure-dir DIR]``: one worker process of a job that
:func:`lowcomm.train.launcher.launch_processes` started (:func:`lowcomm.train.worker.main`).
Users start jobs with ``lowcomm train``; this is the command the launcher runs for them."""

import logging
import os
import sys

from lowcomm.train.worker import main

if __name__ == "__main__":
    code = main()
    # The run is over and its files are written. Skip the interpreter's finalization: objects
    # of gloo's C++ threads released there can abort (SIGABRT) a worker whose run succeeded.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
