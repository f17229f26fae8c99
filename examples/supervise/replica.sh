#!/usr/bin/env bash
# Keep one replica of an elastic lowcomm job running on this machine: start it again whenever it
# dies, with the same command line (the same --replica-id and --out), so that it continues in its
# folder and is healed from the other replicas at their next sync. Stops when the replica
# finishes (exit 0) or is refused (exit 2: a bad setting, which no restart fixes); Ctrl-C or
# SIGTERM stops the loop and the replica.
#
#   LIGHTHOUSE=http://10.0.0.1:29510 REPLICA=replica_0 ./replica.sh --config job.toml
#
# Every argument is passed to `lowcomm train`.
set -u
: "${LIGHTHOUSE:?set LIGHTHOUSE to the address lowcomm lighthouse printed}"
: "${REPLICA:?set REPLICA to the id of this replica, e.g. replica_0}"
OUT=${OUT:-runs/$REPLICA}
RESTART_DELAY=${RESTART_DELAY:-5}

trap 'exit 130' INT TERM
while true; do
  lowcomm train --fault-tolerance --lighthouse "$LIGHTHOUSE" --replica-id "$REPLICA" \
      --out "$OUT" "$@" &
  pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid"; exit 130' INT TERM
  wait "$pid"
  code=$?
  trap 'exit 130' INT TERM
  if [ "$code" -eq 0 ] || [ "$code" -eq 2 ] || [ "$code" -eq 130 ]; then
    exit "$code"
  fi
  echo "replica $REPLICA exited with $code; starting it again in $RESTART_DELAY s" >&2
  sleep "$RESTART_DELAY"
done
