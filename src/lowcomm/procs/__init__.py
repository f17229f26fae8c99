"""Processes: how lowcomm starts them. :mod:`lowcomm.procs.forkserver` forks the workers of
``lowcomm train`` from a server that imported torch once; :mod:`lowcomm.procs.workers` runs a
function on N real processes joined by a process group (what ``lowcomm bench``, ``lowcomm plan``
and lowcomm's tests measure and check with). Neither imports anything of lowcomm above it."""
