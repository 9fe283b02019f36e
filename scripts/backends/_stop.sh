# Sourced by the stop_*.sh scripts: stop_pid_file FILE WHAT stops the process whose pid FILE
# holds (a paused one is continued first; TERM, then KILL after 5 s) and removes FILE.
stop_pid_file() {
  local pid_file=$1 what=$2 pid
  [ -f "$pid_file" ] || return 0
  pid=$(cat "$pid_file")
  if kill -0 "$pid" 2>/dev/null; then
    kill -CONT "$pid" 2>/dev/null; kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    echo "# $what pid $pid stopped"
  fi
  rm -f "$pid_file"
}
