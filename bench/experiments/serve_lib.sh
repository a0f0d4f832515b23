# Shared by the bench/*.sh scripts that measure `radixserve serve` (POSIX sh; source it with
# `. bench/serve_lib.sh` from the checkout's root). PORT must be set.

# start_server LOG [SERVER FLAGS...]: start the server on 127.0.0.1:$PORT in the background
# (its pid in $server) and wait until /health answers (10 minutes at most).
start_server() {
  log=$1
  shift
  .venv/bin/radixserve serve --host 127.0.0.1 --port "$PORT" "$@" >"$log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    sleep 1
  done
  echo "the server did not answer /health within 10 minutes; see $log" >&2
  return 1
}

# stop_server: SIGTERM the server start_server started, and wait for it to exit.
stop_server() {
  kill -TERM "$server"
  wait "$server"
}

# load: the 1, 5 and 15-minute load averages.
load() { cut -d' ' -f1-3 /proc/loadavg; }
