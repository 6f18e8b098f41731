#!/usr/bin/env bash
# Launch helper for jaxrl_agentic on Cloud TPU VMs: one host or every host of a pod slice.
# See docs/tpu.md. `scripts/tpu/launch.sh -h` prints the usage.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/tpu/launch.sh COMMAND [options] [--config.KEY=VALUE ...] [-- ARGS...]

Drives `gcloud compute tpus tpu-vm` for one TPU VM (single host or a multi-host slice).
Every command that touches the workers runs on all of them at once (--worker=all).

Commands:
  create    create the TPU VM (--accelerator-type, --version, --spot)
  setup     copy `git archive REF` of this repository to every worker, unpack it into
            ~/REMOTE_DIR (outputs/ and logs/ there are kept) and `pip install -e .` it
            into ~/VENV together with jax[tpu] (same version range as pyproject.toml)
  check     start JAX on every worker at once (jax.distributed.initialize) and print
            each process's index and its local / global device count
  run       start `python -m jaxrl_agentic.train --config CONFIG
            --config.distributed.enabled=True [--config.KEY=VALUE ...] [ARGS...]`
            on every worker, detached; each worker writes ~/REMOTE_DIR/logs/RUN_NAME.log
  logs      print the last lines of each worker's log (--follow: keep following)
  stop      stop the run started by `run` on every worker (TERM, then KILL after 30 s)
  exec      run a shell command on every worker: `exec -- 'gcloud storage cp -r ...'`
  describe  gcloud compute tpus tpu-vm describe
  delete    delete the TPU VM

Options:
  --name NAME             TPU VM name (env TPU_NAME)                      [required]
  --zone ZONE             zone, e.g. us-central2-b (env TPU_ZONE)         [required]
  --project PROJECT       Google Cloud project (env TPU_PROJECT; default: gcloud's)
  --accelerator-type T    create: e.g. v4-8, v4-32, v5litepod-8, v5litepod-16, v6e-8
                          (env TPU_ACCELERATOR_TYPE; default v4-8)
  --version V             create: TPU software version (env TPU_RUNTIME_VERSION; default
                          from the type: v2/v3/v4 tpu-ubuntu2204-base, v5litepod
                          v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e)
  --spot                  create: a Spot TPU (cheaper, can be preempted at any time)
  --config PATH           run: recipe file, relative to the repository root
                          (default configs/qwen2_5_0_5b_frozen_lake.py)
  --config.KEY=VALUE      run: config override, passed to the trainer (repeatable)
  --no-distributed        run: do not add --config.distributed.enabled=True
  --env KEY=VALUE         run/check/exec: environment variable on the workers (repeatable)
  --run-name NAME         run/logs/stop: name of the log and pid files (default train)
  --foreground            run: stay attached and stream the output (Ctrl-C stops it)
  --follow                logs: keep following (worker 0 unless --worker is given)
  --lines N               logs: lines to show (default 50)
  --worker W              workers to address: all, or an index such as 0 (default all)
  --ref REF               setup: git revision to ship (default HEAD; commit first: the
                          working tree is not shipped)
  --remote-dir DIR        checkout on the workers, relative to $HOME (default jaxrl_agentic)
  --venv DIR              virtualenv on the workers, relative to $HOME (default jaxrl_venv)
  --jax-spec SPEC         setup: the jax requirement (default jax[tpu] with the range of
                          pyproject.toml)
  --yes                   delete: do not ask for confirmation
  --dry-run               print the commands instead of running them (gcloud not needed)
  -h, --help              this text

Examples:
  scripts/tpu/launch.sh create --name my-tpu --zone us-central2-b --accelerator-type v4-32
  scripts/tpu/launch.sh setup  --name my-tpu --zone us-central2-b
  scripts/tpu/launch.sh exec   --name my-tpu --zone us-central2-b -- \
      'gcloud storage cp -r gs://BUCKET/Qwen2.5-0.5B-Instruct ~/models/'
  scripts/tpu/launch.sh check  --name my-tpu --zone us-central2-b
  scripts/tpu/launch.sh run    --name my-tpu --zone us-central2-b \
      --config configs/qwen2_5_0_5b_frozen_lake.py \
      --config.pretrain=/home/me/models/Qwen2.5-0.5B-Instruct \
      --config.output_dir=/mnt/shared/runs/qwen_fl --config.mesh.fsdp=-1 --config.mesh.data=1
  scripts/tpu/launch.sh logs   --name my-tpu --zone us-central2-b --follow
  scripts/tpu/launch.sh stop   --name my-tpu --zone us-central2-b
  scripts/tpu/launch.sh delete --name my-tpu --zone us-central2-b
EOF
}

die() { echo "launch.sh: error: $*" >&2; exit 2; }
note() { echo "launch.sh: $*" >&2; }

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

TPU_NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
PROJECT="${TPU_PROJECT:-}"
ACCELERATOR_TYPE="${TPU_ACCELERATOR_TYPE:-v4-8}"
RUNTIME_VERSION="${TPU_RUNTIME_VERSION:-}"
SPOT=0
CONFIG="configs/qwen2_5_0_5b_frozen_lake.py"
DISTRIBUTED=1
RUN_NAME="train"
FOREGROUND=0
FOLLOW=0
LINES=50
WORKER=""
REF="HEAD"
REMOTE_DIR="jaxrl_agentic"
VENV="jaxrl_venv"
JAX_SPEC=""
YES=0
DRY_RUN=0
COMMAND=""
ENV_VARS=()
TRAIN_ARGS=()
REST=()

# --- argument parsing --------------------------------------------------------------------

need_value() { [[ $# -ge 2 ]] || die "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --spot) SPOT=1; shift ;;
    --no-distributed) DISTRIBUTED=0; shift ;;
    --foreground) FOREGROUND=1; shift ;;
    --follow) FOLLOW=1; shift ;;
    --yes) YES=1; shift ;;
    --name|--zone|--project|--accelerator-type|--version|--config|--env|--run-name|\
    --lines|--worker|--ref|--remote-dir|--venv|--jax-spec)
      need_value "$@"; set -- "$1=$2" "${@:3}" ;;  # normalise to --opt=value
    --name=*) TPU_NAME="${1#*=}"; shift ;;
    --zone=*) ZONE="${1#*=}"; shift ;;
    --project=*) PROJECT="${1#*=}"; shift ;;
    --accelerator-type=*) ACCELERATOR_TYPE="${1#*=}"; shift ;;
    --version=*) RUNTIME_VERSION="${1#*=}"; shift ;;
    --config=*) CONFIG="${1#*=}"; shift ;;
    --config.*=*) TRAIN_ARGS+=("$1"); shift ;;
    --config.*) die "$1: give overrides as --config.KEY=VALUE (one argument)" ;;
    --env=*) [[ "${1#*=}" == *=* ]] || die "--env needs KEY=VALUE, got ${1#*=}"
             ENV_VARS+=("${1#*=}"); shift ;;
    --run-name=*) RUN_NAME="${1#*=}"; shift ;;
    --lines=*) LINES="${1#*=}"; shift ;;
    --worker=*) WORKER="${1#*=}"; shift ;;
    --ref=*) REF="${1#*=}"; shift ;;
    --remote-dir=*) REMOTE_DIR="${1#*=}"; shift ;;
    --venv=*) VENV="${1#*=}"; shift ;;
    --jax-spec=*) JAX_SPEC="${1#*=}"; shift ;;
    --) shift; REST=("$@"); break ;;
    -*) die "unknown option $1 (see -h)" ;;
    *) [[ -z "$COMMAND" ]] || die "more than one command: $COMMAND and $1"
       COMMAND="$1"; shift ;;
  esac
done

[[ -n "$COMMAND" ]] || { usage >&2; exit 2; }
[[ "$RUN_NAME" =~ ^[A-Za-z0-9_.-]+$ ]] || die "--run-name: letters, digits, _ . - only"
[[ "$LINES" =~ ^[0-9]+$ ]] || die "--lines: a number, got $LINES"
[[ -z "$WORKER" || "$WORKER" == all || "$WORKER" =~ ^[0-9]+(,[0-9]+)*$ ]] ||
  die "--worker: 'all' or worker indices such as 0 or 0,1, got $WORKER"
for kv in ${ENV_VARS[@]+"${ENV_VARS[@]}"}; do
  [[ "${kv%%=*}" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--env: bad variable name in $kv"
done

# --- quoting and execution -----------------------------------------------------------------

# One shell word, quoted only when needed (readable dry-run output, safe remote commands).
quote() {
  local s="$1"
  if [[ "$s" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

# A word inside a double-quoted remote string.
dquote() {
  local s="$1"
  s="${s//\\/\\\\}"; s="${s//\"/\\\"}"; s="${s//\$/\\\$}"; s="${s//\`/\\\`}"
  printf '"%s"' "$s"
}

quote_all() {
  local out="" word
  for word in "$@"; do out+="${out:+ }$(quote "$word")"; done
  printf '%s' "$out"
}

run() {
  if [[ $DRY_RUN == 1 ]]; then
    quote_all "$@"; echo
  else
    echo "+ $(quote_all "$@")" >&2
    "$@"
  fi
}

# A path on the workers: relative paths are under $HOME (expanded by the remote shell).
remote_path() {
  # shellcheck disable=SC2016  # $HOME is for the remote shell
  if [[ "$1" == /* ]]; then quote "$1"; else printf '"$HOME"/%s' "$(quote "$1")"; fi
}

RDIR="$(remote_path "$REMOTE_DIR")"
RVENV="$(remote_path "$VENV")"

require_tpu() {
  [[ -n "$TPU_NAME" ]] || die "--name (or TPU_NAME) is required"
  [[ -n "$ZONE" ]] || die "--zone (or TPU_ZONE) is required"
}

gcloud_flags() {
  GFLAGS=("--zone=$ZONE")
  [[ -z "$PROJECT" ]] || GFLAGS+=("--project=$PROJECT")
}

ssh_all() {  # ssh_all REMOTE_COMMAND [DEFAULT_WORKER]
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GFLAGS[@]}" \
    "--worker=${WORKER:-${2:-all}}" "--command=$1"
}

env_exports() {
  local kv out=""
  for kv in ${ENV_VARS[@]+"${ENV_VARS[@]}"}; do
    out+="export ${kv%%=*}=$(quote "${kv#*=}"); "
  done
  printf '%s' "$out"
}

default_runtime_version() {
  case "$1" in
    v2-*|v3-*|v4-*) echo "tpu-ubuntu2204-base" ;;
    v5litepod-*|v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) die "no default --version for accelerator type $1; give --version" ;;
  esac
}

jax_requirement() {  # jax[tpu] with the range pyproject.toml pins jax to
  local range
  range="$(sed -n 's/^[[:space:]]*"jax\([<>=!~][^"]*\)",\{0,1\}[[:space:]]*$/\1/p' \
    "$REPO_ROOT/pyproject.toml" | head -n 1)"
  echo "jax[tpu]${range:->=0.7,<0.12}"
}

# --- commands --------------------------------------------------------------------------

cmd_create() {
  require_tpu; gcloud_flags
  local version
  version="${RUNTIME_VERSION:-$(default_runtime_version "$ACCELERATOR_TYPE")}"
  local args=(gcloud compute tpus tpu-vm create "$TPU_NAME" "${GFLAGS[@]}"
              "--accelerator-type=$ACCELERATOR_TYPE" "--version=$version")
  [[ $SPOT == 0 ]] || args+=(--spot)
  run "${args[@]}"
}

cmd_setup() {
  require_tpu; gcloud_flags
  cd "$REPO_ROOT"
  git rev-parse --verify --quiet "$REF^{commit}" >/dev/null || die "--ref $REF is not a commit"
  if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
    note "warning: uncommitted changes are not shipped; setup copies 'git archive $REF'"
  fi
  local sha tarball spec
  sha="$(git rev-parse --short "$REF")"
  tarball="${TMPDIR:-/tmp}/jaxrl_agentic-$sha.tar.gz"
  spec="${JAX_SPEC:-$(jax_requirement)}"
  run git -C "$REPO_ROOT" archive --format=tar.gz -o "$tarball" "$REF"
  run gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:jaxrl_agentic.tar.gz" \
    "${GFLAGS[@]}" "--worker=${WORKER:-all}"
  # On each worker: replace the sources (keep outputs/ and logs/), find a Python >= 3.11
  # (jax >= 0.7 needs it; tpu-ubuntu2204-base has 3.10), make the venv, install.
  local apt="sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq"
  ssh_all "set -euo pipefail
mkdir -p $RDIR && cd $RDIR
find . -mindepth 1 -maxdepth 1 ! -name outputs ! -name logs -exec rm -rf {} +
tar -xzf \"\$HOME/jaxrl_agentic.tar.gz\"
echo $(quote "$(git rev-parse "$REF")") > .source_revision
PY=
for c in python3.13 python3.12 python3.11 python3; do
  if command -v \$c >/dev/null && \$c -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    PY=\$c; break
  fi
done
if [ -z \"\$PY\" ]; then sudo apt-get update -qq && $apt python3.11 python3.11-venv && PY=python3.11; fi
if [ ! -x $RVENV/bin/python ]; then
  \$PY -m venv $RVENV || { $apt \$PY-venv && \$PY -m venv $RVENV; }
fi
$RVENV/bin/pip install -q -U pip
$RVENV/bin/pip install -q -e . $(dquote "$spec")
$RVENV/bin/python -c \"import jax, jaxrl_agentic, socket; print(socket.gethostname(), 'jax', jax.__version__)\""
}

cmd_check() {
  require_tpu; gcloud_flags
  ssh_all "$(env_exports)cd $RDIR && $RVENV/bin/python -c \"import jax
jax.distributed.initialize()
print(f'process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local,'
      f' {jax.device_count()} global devices ({jax.devices()[0].device_kind})', flush=True)\""
}

cmd_run() {
  require_tpu; gcloud_flags
  [[ -f "$REPO_ROOT/$CONFIG" ]] || die "--config $CONFIG: no such file under $REPO_ROOT"
  if ! git -C "$REPO_ROOT" cat-file -e "$REF:$CONFIG" 2>/dev/null; then
    note "warning: $CONFIG is not in '$REF', so 'setup' did not ship it to the workers"
  fi
  local has_output_dir=0 arg
  for arg in ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} ${REST[@]+"${REST[@]}"}; do
    [[ "$arg" != --config.output_dir=* ]] || has_output_dir=1
  done
  if [[ $has_output_dir == 0 ]]; then
    note "note: no --config.output_dir: each worker checkpoints under ~/$REMOTE_DIR/outputs/;"
    note "      on a multi-host slice give a path all workers share (docs/tpu.md)"
  fi
  local argv=(-m jaxrl_agentic.train --config "$CONFIG")
  [[ $DISTRIBUTED == 0 ]] || argv+=(--config.distributed.enabled=True)
  argv+=(${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} ${REST[@]+"${REST[@]}"})
  # The interpreter path stays outside quote_all so that $HOME expands on the worker.
  local cmdline
  cmdline="$RVENV/bin/python $(quote_all "${argv[@]}")"
  local log="logs/$RUN_NAME.log" pidf="logs/$RUN_NAME.pid"
  local remote
  remote="$(env_exports)set -e
cd $RDIR && mkdir -p logs
if [ -f $pidf ] && kill -0 \"\$(cat $pidf)\" 2>/dev/null; then
  echo \"\$(hostname): $RUN_NAME is already running (pid \$(cat $pidf)); stop it first\" >&2; exit 1
fi
echo \"# \$(date -u +%FT%TZ) \$(hostname) source \$(cat .source_revision 2>/dev/null || echo unknown)\" > $log
"
  if [[ $FOREGROUND == 1 ]]; then
    remote+="set -o pipefail
$cmdline 2>&1 < /dev/null | tee -a $log"
  else
    # setsid: own session and process group, so the run survives the ssh session and
    # `stop` can signal the whole group.
    remote+="nohup setsid $cmdline >> $log 2>&1 < /dev/null &
pid=\$!
echo \$pid > $pidf
sleep 10
if ! kill -0 \$pid 2>/dev/null; then
  echo \"\$(hostname): $RUN_NAME exited within 10 s; end of \$PWD/$log:\" >&2; tail -n 20 $log >&2; exit 1
fi
echo \"\$(hostname): started pid \$pid, log \$PWD/$log\""
  fi
  ssh_all "$remote"
  if [[ $FOREGROUND == 0 && $DRY_RUN == 0 ]]; then
    note "started; follow with: $0 logs --name $TPU_NAME --zone $ZONE --follow"
  fi
}

cmd_logs() {
  require_tpu; gcloud_flags
  local default_worker=all follow=""
  if [[ $FOLLOW == 1 ]]; then default_worker=0; follow=" -F"; fi
  ssh_all "cd $RDIR && h=\$(hostname) && tail -n $LINES$follow logs/$RUN_NAME.log | sed -u \"s/^/[\$h] /\"" \
    "$default_worker"
}

cmd_stop() {
  require_tpu; gcloud_flags
  local pidf="logs/$RUN_NAME.pid"
  ssh_all "cd $RDIR 2>/dev/null || exit 0
if [ -f $pidf ] && pid=\$(cat $pidf) && kill -0 \"\$pid\" 2>/dev/null; then
  kill -TERM -- -\"\$pid\"
  for i in \$(seq 30); do kill -0 \"\$pid\" 2>/dev/null || break; sleep 1; done
  if kill -0 \"\$pid\" 2>/dev/null; then kill -KILL -- -\"\$pid\"; fi
  echo \"\$(hostname): stopped $RUN_NAME (pid \$pid)\"
else
  echo \"\$(hostname): $RUN_NAME is not running\"
fi
rm -f $pidf"
}

cmd_exec() {
  require_tpu; gcloud_flags
  [[ ${#REST[@]} -gt 0 ]] || die "exec needs a command after --"
  ssh_all "$(env_exports)if [ -f $RVENV/bin/activate ]; then . $RVENV/bin/activate; fi
${REST[*]}"
}

cmd_describe() {
  require_tpu; gcloud_flags
  run gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GFLAGS[@]}"
}

cmd_delete() {
  require_tpu; gcloud_flags
  local args=(gcloud compute tpus tpu-vm delete "$TPU_NAME" "${GFLAGS[@]}")
  [[ $YES == 0 ]] || args+=(--quiet)
  run "${args[@]}"
}

case "$COMMAND" in
  create|setup|check|run|logs|stop|exec|describe|delete)
    if [[ $DRY_RUN == 0 ]] && ! command -v gcloud >/dev/null; then
      die "gcloud not found (install the Google Cloud CLI, or use --dry-run)"
    fi
    if [[ ${#REST[@]} -gt 0 && "$COMMAND" != run && "$COMMAND" != exec ]]; then
      die "arguments after -- only go with run and exec"
    fi
    if [[ ${#TRAIN_ARGS[@]} -gt 0 && "$COMMAND" != run ]]; then
      die "--config.KEY=VALUE overrides only go with run"
    fi
    "cmd_$COMMAND" ;;
  *) die "unknown command $COMMAND (see -h)" ;;
esac
