#!/usr/bin/env bash
# Try a multi-host run on one machine: N trainer processes on the CPU, joined by
# jax.distributed through a coordinator on 127.0.0.1. See docs/tpu.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/tpu/local_multiprocess.sh [options] --config PATH [--config.KEY=VALUE ...] [-- ARGS...]

Starts N processes of `python -m jaxrl_agentic.train` on this machine, each with
JAX_PLATFORMS=cpu and

  --config.distributed.enabled=True
  --config.distributed.coordinator_address=127.0.0.1:PORT
  --config.distributed.num_processes=N
  --config.distributed.process_id=i          (i = 0 .. N-1)

after your own --config.* overrides. Process 0's output is shown here; every process
writes LOG_DIR/process_<i>.log. The script waits for all of them. When one fails it stops
the others (they would wait for it forever) and exits with the failing process's code.

CPU collectives across processes use gloo; the trainer selects it itself when
distributed is enabled on CPU (jax_cpu_collectives_implementation="gloo"), and this
script also exports JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo.

The processes share this machine's filesystem, so output_dir (checkpoints) is shared
as it must be on a real multi-host run.

Options:
  -n, --num-processes N       processes (default 2)
  -d, --devices-per-process K CPU devices per process, via
                              XLA_FLAGS=--xla_force_host_platform_device_count=K
                              (default 1; the global mesh has N*K devices)
  --port PORT                 coordinator port on 127.0.0.1 (default 12355)
  --log-dir DIR               per-process logs (default outputs/local_multiprocess)
  --timeout SECONDS           stop everything and fail after this long (default 0 = none)
  --python PY                 interpreter (default: $PYTHON, else python)
  --config PATH               recipe file                                   [required]
  --config.KEY=VALUE          config override for every process (repeatable)
  --dry-run                   print the commands instead of running them
  -h, --help                  this text

Example (2 processes x 2 CPU devices, parameters sharded over all 4):
  scripts/tpu/local_multiprocess.sh -n 2 -d 2 --config configs/frozen_lake.py \
      --config.max_steps=2 --config.mesh.data=1 --config.mesh.fsdp=-1 \
      --config.output_dir=outputs/mp_try
EOF
}

die() { echo "local_multiprocess.sh: error: $*" >&2; exit 2; }
note() { echo "local_multiprocess.sh: $*" >&2; }

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NUM_PROCESSES=2
DEVICES_PER_PROCESS=1
PORT=12355
LOG_DIR="outputs/local_multiprocess"
TIMEOUT=0
PY="${PYTHON:-python}"
CONFIG=""
DRY_RUN=0
TRAIN_ARGS=()

need_value() { [[ $# -ge 2 ]] || die "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -n|--num-processes|-d|--devices-per-process|--port|--log-dir|--timeout|--python|--config)
      need_value "$@"; set -- "$1=$2" "${@:3}" ;;
    -n=*|--num-processes=*) NUM_PROCESSES="${1#*=}"; shift ;;
    -d=*|--devices-per-process=*) DEVICES_PER_PROCESS="${1#*=}"; shift ;;
    --port=*) PORT="${1#*=}"; shift ;;
    --log-dir=*) LOG_DIR="${1#*=}"; shift ;;
    --timeout=*) TIMEOUT="${1#*=}"; shift ;;
    --python=*) PY="${1#*=}"; shift ;;
    --config=*) CONFIG="${1#*=}"; shift ;;
    --config.distributed.*) die "$1: this script sets config.distributed.* itself" ;;
    --config.*=*) TRAIN_ARGS+=("$1"); shift ;;
    --config.*) die "$1: give overrides as --config.KEY=VALUE (one argument)" ;;
    --) shift; TRAIN_ARGS+=("$@"); break ;;
    *) die "unknown argument $1 (see -h)" ;;
  esac
done

[[ -n "$CONFIG" ]] || { usage >&2; exit 2; }
for value in "$NUM_PROCESSES" "$DEVICES_PER_PROCESS" "$PORT" "$TIMEOUT"; do
  [[ "$value" =~ ^[0-9]+$ ]] || die "expected a non-negative integer, got '$value'"
done
(( NUM_PROCESSES >= 1 )) || die "--num-processes must be >= 1"
(( DEVICES_PER_PROCESS >= 1 )) || die "--devices-per-process must be >= 1"
(( PORT >= 1 && PORT <= 65535 )) || die "--port must be in 1..65535"

cd "$REPO_ROOT"
[[ -f "$CONFIG" ]] || die "--config $CONFIG: no such file (paths are relative to $REPO_ROOT)"

quote_all() {
  local out="" word
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then out+="${out:+ }$word"
    else out+="${out:+ }'${word//\'/\'\\\'\'}'"; fi
  done
  printf '%s' "$out"
}

XLA="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$DEVICES_PER_PROCESS"
process_env() {
  ENVV=(JAX_PLATFORMS=cpu JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo "XLA_FLAGS=$XLA")
}
process_argv() {  # process_argv i
  ARGV=("$PY" -m jaxrl_agentic.train --config "$CONFIG"
        ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}
        --config.distributed.enabled=True
        "--config.distributed.coordinator_address=127.0.0.1:$PORT"
        "--config.distributed.num_processes=$NUM_PROCESSES"
        "--config.distributed.process_id=$1")
}

if [[ $DRY_RUN == 1 ]]; then
  process_env
  for ((i = 0; i < NUM_PROCESSES; i++)); do
    process_argv "$i"
    echo "$(quote_all env "${ENVV[@]}" "${ARGV[@]}") > $(quote_all "$LOG_DIR/process_$i.log") 2>&1 &"
  done
  echo "wait  # for all $NUM_PROCESSES; on the first failure stop the others"
  exit 0
fi

command -v "$PY" >/dev/null || die "python interpreter '$PY' not found (--python or \$PYTHON)"
if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
  die "something already listens on 127.0.0.1:$PORT; choose another --port"
fi
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR"/process_*.rc "$LOG_DIR"/process_*.pid

PIDS=()       # the trainer processes
WRAPPERS=()   # their wrapper subshells
EXITED=()       # 1 when process i has exited
TAIL_PID=""

stop_all() {  # stop_all SIGNAL: signal every trainer process still running
  local i pid
  for ((i = 0; i < NUM_PROCESSES; i++)); do
    pid="${PIDS[$i]:-}"
    if [[ -n "$pid" && "${EXITED[$i]:-0}" == 0 ]]; then kill "-$1" "$pid" 2>/dev/null || true; fi
  done
}

on_interrupt() {
  note "interrupted; stopping all processes"
  stop_all TERM; sleep 2; stop_all KILL
  [[ -z "$TAIL_PID" ]] || kill "$TAIL_PID" 2>/dev/null || true
  exit 130
}
trap on_interrupt INT TERM

process_env
note "starting $NUM_PROCESSES processes x $DEVICES_PER_PROCESS CPU device(s), coordinator 127.0.0.1:$PORT, logs in $LOG_DIR/"
for ((i = 0; i < NUM_PROCESSES; i++)); do
  process_argv "$i"
  log="$LOG_DIR/process_$i.log"
  echo "# $(quote_all env "${ENVV[@]}" "${ARGV[@]}")" > "$log"
  # A small wrapper per process records the trainer's pid and, when it ends, its exit code
  # (polling our own children with `kill -0` would see zombies as alive).
  (
    trap - INT TERM
    env "${ENVV[@]}" "${ARGV[@]}" >> "$log" 2>&1 < /dev/null &
    echo $! > "$LOG_DIR/process_$i.pid"
    rc=0; wait $! || rc=$?
    echo "$rc" > "$LOG_DIR/process_$i.rc"
  ) &
  WRAPPERS[i]=$!
  until [[ -s "$LOG_DIR/process_$i.pid" ]]; do sleep 0.1; done
  PIDS[i]="$(cat "$LOG_DIR/process_$i.pid")"
  EXITED[i]=0
done

# Show process 0 as it runs (the other processes only log to their files).
tail -n +1 -f "$LOG_DIR/process_0.log" &
TAIL_PID=$!

start=$SECONDS
finished=0
first_rc=0
first_failed=""
stop_deadline=""
while (( finished < NUM_PROCESSES )); do
  for ((i = 0; i < NUM_PROCESSES; i++)); do
    [[ "${EXITED[$i]}" == 0 && -s "$LOG_DIR/process_$i.rc" ]] || continue
    EXITED[i]=1
    finished=$((finished + 1))
    rc="$(cat "$LOG_DIR/process_$i.rc")"
    if [[ "$rc" != 0 && -z "$first_failed" ]]; then
      first_failed=$i; first_rc=$rc
      note "process $i exited with code $rc; stopping the others"
      stop_all TERM
      stop_deadline=$((SECONDS + 15))
    fi
  done
  if [[ -n "$stop_deadline" ]] && (( SECONDS >= stop_deadline )); then
    stop_all KILL; stop_deadline=""
  fi
  if (( TIMEOUT > 0 && SECONDS - start >= TIMEOUT )) && [[ -z "$first_failed" ]]; then
    note "timed out after ${TIMEOUT}s (a hang? see $LOG_DIR/); stopping all processes"
    first_failed=timeout; first_rc=124
    stop_all TERM
    stop_deadline=$((SECONDS + 15))
  fi
  sleep 1
done
wait "${WRAPPERS[@]}"
sleep 0.5
kill "$TAIL_PID" 2>/dev/null || true
wait "$TAIL_PID" 2>/dev/null || true

echo >&2
for ((i = 0; i < NUM_PROCESSES; i++)); do
  note "process $i: exit code $(cat "$LOG_DIR/process_$i.rc"), log $LOG_DIR/process_$i.log"
done
if [[ -n "$first_failed" ]]; then
  if [[ "$first_failed" != timeout && "$first_failed" != 0 ]]; then
    note "end of $LOG_DIR/process_$first_failed.log:"
    tail -n 20 "$LOG_DIR/process_$first_failed.log" >&2
  fi
  exit "$first_rc"
fi
note "all $NUM_PROCESSES processes finished"
