#!/usr/bin/env bash
# Launch megatron_async_rl on one node with torchrun.
#
# Usage: launch/torchrun.sh RECIPE.yaml [entry-point args...]
#   e.g. launch/torchrun.sh yaml_configs/tiny.yaml --set scheduler.generate_ahead_steps=2 \
#            -- --tensor-model-parallel-size 2 --lr 1e-6
# Everything after RECIPE (including `--` and the Megatron flags after it) reaches
# `python -m megatron_async_rl.train` verbatim.
#
# Environment knobs (default in brackets):
#   NPROC_PER_NODE      ranks on this node [GPUs listed by `nvidia-smi -L`; 4 when there are
#                       none (CPU/gloo). nvidia-smi ignores CUDA_VISIBLE_DEVICES: set this when
#                       you restrict the devices]
#   MASTER_ADDR         rendezvous address [127.0.0.1]
#   MASTER_PORT         rendezvous port [29500]
#   PYTHON              interpreter [<repo>/.venv/bin/python if present, else python3]; it runs
#                       `-m torch.distributed.run`, so that environment's torch is the one used
#   RUN_DIR             passed as `--run-dir RUN_DIR` before your args [unset: not passed]
#   OMP_NUM_THREADS     [1 when no GPU is found, else left as is]; threads per rank, so CPU
#                       ranks do not oversubscribe the cores
#   MAX_RESTARTS        torchrun --max-restarts [0]: times a failed world is restarted; each
#                       restart resumes from the newest complete checkpoint by itself
#                       (checkpoint.resume: auto). On a cluster, 2-5
#   SHUTDOWN_TIMEOUT    torchrun --shutdown-timeout, seconds [120]: on SIGTERM or SIGUSR1 to
#                       this script, the ranks save a checkpoint at the next step boundary and
#                       this script exits 83 (preempted: resume with the same command); ranks
#                       still running after this many seconds are killed. Leave room for a
#                       step plus a save
#   ORPHAN_GRACE        seconds [20]: if this script is killed without handing a signal on
#                       (kill -9), the job stops as on SIGTERM and what runs after this many
#                       seconds is killed: no rank, engine or torchrun outlives its launcher
#   TORCHRUN_EXTRA_ARGS extra torchrun flags, split on whitespace, placed after the ones above
#                       (e.g. "--max-restarts 2 --redirects 3") [empty]
#   DRY_RUN=1           print the exact command on one line and exit 0 without running it
#   SKIP_VALIDATE=1     do not check the recipe first (by default one process runs the entry
#                       point with --dry-run --here --world-size NPROC_PER_NODE --ranks-per-node
#                       NPROC_PER_NODE, so a bad recipe or flag ends with one message and exit
#                       code 2 before any rank starts)
#   VALIDATE_HERE=0     that check skips paths this machine lacks (checkpoint, data), with a
#                       warning, instead of requiring them [1: they must exist here]
# The repository root is prepended to PYTHONPATH so the package imports from any directory.
# Errors in the arguments or knobs print the name, the value and the rule, and exit 2.
set -euo pipefail

die() {
    printf 'torchrun.sh: %s\n' "$1" >&2
    printf 'usage: launch/torchrun.sh RECIPE.yaml [args...]; knobs: see its header\n' >&2
    exit 2
}

repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

(($# >= 1)) || die "missing argument RECIPE: the recipe YAML must be the first argument"
recipe=$1
shift
[[ -f $recipe ]] ||
    die "argument RECIPE='$recipe' is not a file: pass a recipe YAML first (--config is added)"

num_gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && gpu_listing=$(nvidia-smi -L 2>/dev/null); then
    num_gpus=$(grep -c '^GPU ' <<<"$gpu_listing" || true)
fi

if ((num_gpus > 0)); then
    nproc_per_node=${NPROC_PER_NODE:-$num_gpus}
else
    nproc_per_node=${NPROC_PER_NODE:-4}
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
[[ $nproc_per_node =~ ^[1-9][0-9]*$ ]] ||
    die "NPROC_PER_NODE='$nproc_per_node' must be a positive integer (ranks on this node)"

master_addr=${MASTER_ADDR:-127.0.0.1}
master_port=${MASTER_PORT:-29500}
if ! [[ $master_port =~ ^[1-9][0-9]{0,4}$ ]] || ((master_port > 65535)); then
    die "MASTER_PORT='$master_port' must be an integer in 1..65535"
fi

if [[ -z ${PYTHON:-} && -x $repo_dir/.venv/bin/python ]]; then
    python=$repo_dir/.venv/bin/python
else
    python=${PYTHON:-python3}
fi
command -v "$python" >/dev/null 2>&1 || die "PYTHON='$python' is not an executable command"

max_restarts=${MAX_RESTARTS:-0}
[[ $max_restarts =~ ^[0-9]+$ ]] || die "MAX_RESTARTS='$max_restarts' must be an integer >= 0"
shutdown_timeout=${SHUTDOWN_TIMEOUT:-120}
[[ $shutdown_timeout =~ ^[1-9][0-9]*$ ]] ||
    die "SHUTDOWN_TIMEOUT='$shutdown_timeout' must be a positive integer (seconds)"
orphan_grace=${ORPHAN_GRACE:-20}
[[ $orphan_grace =~ ^[1-9][0-9]*$ ]] ||
    die "ORPHAN_GRACE='$orphan_grace' must be a positive integer (seconds)"

read -r -a torchrun_extra <<<"${TORCHRUN_EXTRA_ARGS:-}"
run_dir_args=()
[[ -z ${RUN_DIR:-} ]] || run_dir_args=(--run-dir "$RUN_DIR")

cmd=(
    "$python" -m torch.distributed.run
    --nnodes 1 --nproc-per-node "$nproc_per_node"
    --master-addr "$master_addr" --master-port "$master_port"
    --max-restarts "$max_restarts" --shutdown-timeout "$shutdown_timeout"
    "${torchrun_extra[@]}"
    -m megatron_async_rl.train --config "$recipe" "${run_dir_args[@]}" "$@"
)

if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf -v line '%q ' "${cmd[@]}"
    printf '%s\n' "${line% }"
    exit 0
fi

export PYTHONPATH="$repo_dir${PYTHONPATH:+:$PYTHONPATH}"
here=--here  # the job runs here: the checkpoint, data and tokenizer must exist
[[ ${VALIDATE_HERE:-1} == 0 ]] && here=""
if [[ ${SKIP_VALIDATE:-0} != 1 ]]; then
    "$python" -m megatron_async_rl.train --config "$recipe" "${run_dir_args[@]}" \
        --dry-run $here --world-size "$nproc_per_node" --ranks-per-node "$nproc_per_node" \
        "$@" >/dev/null || exit $?
    export MEGATRON_ASYNC_RL_VALIDATED=1  # the ranks need not repeat what the check printed
fi
# Not exec. torchrun runs in a session of its own (setsid), so a terminal's Ctrl-C reaches this
# script alone, and this script hands each signal to the ranks (torchrun's children), not to
# torchrun, which would print a traceback for it:
# - SIGTERM or SIGUSR1 (preemption): the ranks save at the next step boundary; the leader
#   leaves a marker, every rank exits 0 so torchrun ends quietly, and this script exits 83
#   (requeue). Ranks still running SHUTDOWN_TIMEOUT seconds later are stopped by torchrun.
# - Ctrl-C (SIGINT): the same save and stop, reported as an interruption (the other marker):
#   exit 130. Ctrl-C again, a second later or more: the ranks stop at once, no checkpoint.
marker=$(mktemp -u "${TMPDIR:-/tmp}/megatron_async_rl_preempted.XXXXXX")
interrupted=$(mktemp -u "${TMPDIR:-/tmp}/megatron_async_rl_interrupted.XXXXXX")
export MEGATRON_ASYNC_RL_PREEMPTED_FILE=$marker MEGATRON_ASYNC_RL_INTERRUPTED_FILE=$interrupted
setsid "${cmd[@]}" &
child=$!
# If this script dies without handing a signal on (kill -9, a crashed terminal or CI runner),
# torchrun, in its own session, would go on training, detached. A watch, a child of this script
# that ignores the signals meant for it, checks twice a second that this script is still its
# parent; once it is not, it stops the job as a preemption does (the ranks save at the next
# step boundary and stop), and after ORPHAN_GRACE seconds (20) kills what is left: torchrun and
# its ranks (an engine host ends with its rank). It ends by itself once torchrun has.
launcher=$$
(
    trap '' INT TERM USR1
    me=$BASHPID
    parent() { # of this watch, from /proc/PID/stat: "pid (comm) state ppid ..."
        local stat
        read -r stat <"/proc/$me/stat" || return 0
        set -- ${stat##*) }
        echo "$2"
    }
    while kill -0 "$child" 2>/dev/null; do
        if [[ $(parent) != "$launcher" ]]; then
            printf 'torchrun.sh: the launcher (pid %s) died: stopping its job\n' "$launcher" >&2
            pkill -TERM -P "$child" 2>/dev/null || true
            for ((i = 0; i < orphan_grace * 2; i++)); do
                kill -0 "$child" 2>/dev/null || break
                sleep 0.5
            done
            pkill -KILL -P "$child" 2>/dev/null || true
            kill -KILL "$child" 2>/dev/null || true
            rm -f "$marker" "$interrupted"
            exit 0
        fi
        sleep 0.5
    done
) &
watch=$!
deadline=""
preempt() {
    pkill -TERM -P "$child" 2>/dev/null || kill -TERM "$child" 2>/dev/null || true
    deadline=$((SECONDS + shutdown_timeout))
}
trap preempt TERM USR1
trap 'pkill -INT -P "$child" 2>/dev/null || true' INT
while kill -0 "$child" 2>/dev/null; do
    if [[ -n $deadline && $SECONDS -ge $deadline ]]; then
        kill -TERM "$child" 2>/dev/null || true # ranks still running: torchrun stops them
        deadline=""
    fi
    sleep 0.5 &
    wait $! 2>/dev/null || true # returns at once when a trapped signal arrives
done
status=0
wait "$child" || status=$?
wait "$watch" 2>/dev/null || true # it ends within half a second of torchrun
if [[ -f $marker ]]; then
    rm -f "$marker"
    exit 83
fi
if [[ -f $interrupted ]]; then
    rm -f "$interrupted"
    exit 130
fi
exit "$status"
