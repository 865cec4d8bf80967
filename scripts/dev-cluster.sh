#!/usr/bin/env bash
# A real Slurm cluster on this one host, for end-to-end tests and the laptop demo.
#
# Usage: scripts/dev-cluster.sh start|stop|status [--state-dir DIR]
#
# Three emulated nodes, node1 to node3 (one `slurmd -N nodeK` each, 4 CPUs each, all on 127.0.0.1): node1 and
# node2 in the default partition `debug`, all three in partition `wide` (a job that loses a node and is requeued
# without it has a third to go to). Everything the cluster writes (config, pid files, logs, spool, controller state,
# job completion log) lives in the state dir: --state-dir DIR, else $ACCELPACT_DEV_CLUSTER_DIR, else
# /tmp/accelpact-dev-cluster. Clients find the cluster through SLURM_CONF=<state dir>/slurm.conf; the same file
# is also installed as /etc/slurm/slurm.conf so that plain `sbatch` works for every user of the machine.
#
#   start   install slurm-wlm + munge if slurmctld is missing, write the config, start munged, slurmctld and
#           the slurmds, and wait (with a deadline) until every node has registered and are idle (or busy with
#           jobs a restarted controller recovered). Idempotent: when everything is already up with the same config
#           it only reports; a daemon that died is started again; when the config changed it restarts the cluster.
#   stop    cancel every job, wait (with a deadline) for them to leave, then end the daemons this script
#           started, by their pid files.
#   status  daemon pids and liveness, then sinfo and squeue. Exit 0 when everything is up, 3 otherwise.
#
# Environment: ACCELPACT_DEV_CLUSTER_DIR (state dir), ACCELPACT_DEV_CLUSTER_TIMEOUT (seconds per wait, default 60).
# Facts behind the settings: shared/notes/slurm-dev-cluster.md.
set -euo pipefail

readonly PROG="dev-cluster"
readonly NODES=(node1 node2 node3)
readonly NODE_PORTS="17001-17003"
readonly NODE_CPUS=4
readonly NODE_MEM_MB=4000
readonly CTLD_PORT=6817
readonly ETC_CONF=/etc/slurm/slurm.conf
# First line of every config we write: lets us recognise (and only ever overwrite) our own /etc/slurm/slurm.conf.
readonly MARKER="# Managed by AccelPact scripts/dev-cluster.sh"
TIMEOUT="${ACCELPACT_DEV_CLUSTER_TIMEOUT:-60}"

log() { printf '%s: %s\n' "$PROG" "$*"; }
warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }
die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 1
}
usage() {
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# ---------------------------------------------------------------------------------------------------------------
# Arguments: flag > environment > default.
cmd=""
state_dir="${ACCELPACT_DEV_CLUSTER_DIR:-/tmp/accelpact-dev-cluster}"
while (($#)); do
  case "$1" in
  start | stop | status)
    [[ -z $cmd ]] || die "more than one command given ('$cmd' and '$1')"
    cmd="$1"
    ;;
  --state-dir)
    (($# >= 2)) || die "--state-dir needs a directory"
    state_dir="$2"
    shift
    ;;
  --state-dir=*) state_dir="${1#--state-dir=}" ;;
  -h | --help)
    usage
    exit 0
    ;;
  *) die "unknown argument '$1' (usage: $0 start|stop|status [--state-dir DIR])" ;;
  esac
  shift
done
[[ -n $cmd ]] || die "no command (usage: $0 start|stop|status [--state-dir DIR])"
[[ $TIMEOUT =~ ^[0-9]+$ && $TIMEOUT -gt 0 ]] || die "ACCELPACT_DEV_CLUSTER_TIMEOUT must be a positive integer, got '$TIMEOUT'"

state_dir="$(realpath -m -- "$state_dir")"
# slurm.conf has no quoting: a space or '#' would split or end a path, and '%' is expanded (%n = node name).
[[ $state_dir =~ ^/[A-Za-z0-9._/+@-]+$ ]] ||
  die "state dir '$state_dir' must be an absolute path of letters, digits and ._/+@- only (slurm.conf cannot quote)"

readonly STATE="$state_dir"
readonly CONF="$STATE/slurm.conf"
readonly RUN="$STATE/run"
readonly LOGS="$STATE/log"
readonly SPOOL="$STATE/spool"
readonly CTLD_STATE="$STATE/ctld"
readonly JOBCOMP="$STATE/jobcomp.txt"
readonly LOCK="$STATE/.lock"
# Present only when this script started munged (a munged that was already running is reused, never stopped).
readonly MUNGED_PIDFILE="$RUN/munged.pid"
readonly CTLD_PIDFILE="$RUN/slurmctld.pid"
slurmd_pidfile() { printf '%s/slurmd-%s.pid' "$RUN" "$1"; }
slurmd_log() { printf '%s/slurmd-%s.log' "$LOGS" "$1"; }
export SLURM_CONF="$CONF"

is_root() { [[ $(id -u) -eq 0 ]]; }
need_root() { is_root || die "$1 needs root (try: sudo $0 $cmd --state-dir '$STATE')"; }

# ---------------------------------------------------------------------------------------------------------------
# Processes, by pid file. The name check prevents signalling an unrelated process that reused a stale pid.

# proc_is PID NAME: succeed while PID is a live process called NAME. A zombie counts as dead: a daemon that exited
# (stopped, or failed right after forking) stays a zombie, name and all, until init reaps it, which took 1-2 s
# here (gVisor); without this check 'stop' waits for that and 'start' takes a failed daemon for a running one.
proc_is() {
  local comm stat
  comm="$(cat "/proc/$1/comm" 2>/dev/null)" || return 1
  [[ $comm == "$2" ]] || return 1
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }" # the state letter follows the last ')' (the name itself may hold one)
  [[ ${stat:0:1} != [ZXx] ]]
}

# pid_of PIDFILE NAME: print the pid and succeed when the pid file names a live process called NAME.
pid_of() {
  local pidfile="$1" name="$2" pid
  pid="$(tr -dc '0-9' 2>/dev/null <"$pidfile")" || return 1
  [[ -n $pid ]] && proc_is "$pid" "$name" || return 1
  printf '%s' "$pid"
}

# stop_daemons NAME:PIDFILE...: SIGTERM to every one at once, then wait for all under one deadline, then SIGKILL
# what is left. Waits on the processes, not on their pid files: slurmd and
# slurmctld unlink theirs early in their shutdown.
stop_daemons() {
  local spec name pidfile pid deadline i
  local -a pids=() names=()
  for spec in "$@"; do
    name="${spec%%:*}"
    pidfile="${spec#*:}"
    if pid="$(pid_of "$pidfile" "$name")"; then
      log "stopping $(basename -- "$pidfile" .pid) (pid $pid)"
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
      names+=("$name")
    fi
    rm -f -- "$pidfile"
  done
  deadline=$((SECONDS + TIMEOUT))
  for i in "${!pids[@]}"; do
    while proc_is "${pids[i]}" "${names[i]}"; do
      if ((SECONDS >= deadline)); then
        warn "${names[i]} (pid ${pids[i]}) ignored SIGTERM for ${TIMEOUT}s: sending SIGKILL"
        kill -KILL "${pids[i]}" 2>/dev/null || true
        break
      fi
      sleep 0.1
    done
  done
}

# dump_log FILE: the tail of a daemon log, for failure messages.
dump_log() {
  local file="$1"
  if [[ -r $file ]]; then
    printf '%s: ---- last lines of %s ----\n' "$PROG" "$file" >&2
    tail -n 40 -- "$file" >&2 || true
    printf '%s: ---- end of %s ----\n' "$PROG" "$file" >&2
  else
    printf '%s: (no log at %s)\n' "$PROG" "$file" >&2
  fi
}

fail_with_log() {
  local msg="$1"
  shift
  local f
  printf '%s: error: %s\n' "$PROG" "$msg" >&2
  for f in "$@"; do dump_log "$f"; done
  exit 1
}

# ---------------------------------------------------------------------------------------------------------------
# Installation and configuration.

ensure_installed() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  need_root "installing slurm-wlm and munge"
  log "installing slurm-wlm munge (apt-get)"
  local t0
  t0="$(now)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q || die "apt-get update failed"
  apt-get install -y -q --no-install-recommends slurm-wlm munge || die "apt-get install slurm-wlm munge failed"
  log "installed in $(elapsed "$t0")s"
}

render_conf() {
  local host
  host="$(hostname -s)"
  cat <<EOF
$MARKER: 2 emulated nodes for tests.
# Rewritten by 'start' (edits are lost); its state dir is $STATE.
ClusterName=accelpact-dev
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again only after cred_expire (default 120 s; 5 is Slurm's least): keep tests fast.
AuthInfo=cred_expire=5
StateSaveLocation=$CTLD_STATE
SlurmdSpoolDir=$SPOOL/%n
SlurmctldPidFile=$CTLD_PIDFILE
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups here: processes are tracked by parentage, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Defaults schedule every 30-60 s, which makes every requeue test slow.
SchedulerParameters=bf_interval=1,sched_interval=2
# Lets each emulated node claim $NODE_CPUS CPUs whatever the machine has.
SlurmdParameters=config_overrides
# A node that comes back (slurmd restarted) returns to service by itself.
ReturnToService=2
MpiDefault=none
KillWait=5
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: 'sacct -c' reads this completion log (one line per run of a job).
JobCompType=jobcomp/filetxt
JobCompLoc=$JOBCOMP
NodeName=node[1-3] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$NODE_PORTS] CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
PartitionName=wide Nodes=node[1-3] MaxTime=INFINITE State=UP
EOF
}

# Without these, a rendezvous address taken from the node list (scontrol show hostnames) does not resolve.
ensure_hosts() {
  local n missing=0
  for n in "${NODES[@]}"; do
    [[ $(getent ahostsv4 "$n" 2>/dev/null | awk 'NR == 1 { print $1 }') == 127.0.0.1 ]] || missing=1
  done
  ((missing)) || return 0
  need_root "adding node names to /etc/hosts"
  log "adding '127.0.0.1 ${NODES[*]}' to /etc/hosts"
  # Append in place (no sed -i): /etc/hosts is often a bind mount that cannot be replaced.
  printf '127.0.0.1 %s\n' "${NODES[*]}" >>/etc/hosts
}

# install_etc_conf: copy our config to /etc/slurm/slurm.conf, but never overwrite a config that is not ours.
install_etc_conf() {
  if [[ -f $ETC_CONF ]] && cmp -s -- "$CONF" "$ETC_CONF"; then
    return 0
  fi
  if [[ -f $ETC_CONF ]] && [[ $(head -n 1 -- "$ETC_CONF") != "$MARKER"* ]]; then
    warn "$ETC_CONF exists and was not written by this script: left alone; use SLURM_CONF=$CONF"
    return 0
  fi
  if ! is_root; then
    warn "$ETC_CONF is missing or stale and only root can install it; use SLURM_CONF=$CONF"
    return 0
  fi
  log "installing $ETC_CONF (plain sbatch/squeue now reach this cluster)"
  install -d -m 0755 /etc/slurm
  install -m 0644 -- "$CONF" "$ETC_CONF"
}

# ---------------------------------------------------------------------------------------------------------------
# Daemons.

munge_works() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munged() {
  if munge_works; then
    if pid_of "$MUNGED_PIDFILE" munged >/dev/null; then
      log "munged: running (pid $(pid_of "$MUNGED_PIDFILE" munged))"
    else
      log "munged: already running, not started by this script (reused, will not be stopped)"
    fi
    return 0
  fi
  need_root "starting munged"
  [[ -r /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing (reinstall munge: apt-get install --reinstall munge)"
  install -d -o munge -g munge -m 0755 /run/munge
  log "starting munged (as user munge)"
  # munged runs as user munge, so it writes its pid file in its own /run/munge; ours is a root-owned copy.
  local own_pidfile=/run/munge/munged.pid
  rm -f -- "$own_pidfile"
  runuser -u munge -- munged --pid-file="$own_pidfile" 2>>"$LOGS/munged.start.log" 9>&- ||
    fail_with_log "munged did not start" "$LOGS/munged.start.log" /var/log/munge/munged.log
  local deadline=$((SECONDS + TIMEOUT))
  until munge_works && pid_of "$own_pidfile" munged >/dev/null; do
    ((SECONDS < deadline)) || fail_with_log "munged not answering after ${TIMEOUT}s" /var/log/munge/munged.log
    sleep 0.1
  done
  pid_of "$own_pidfile" munged >"$MUNGED_PIDFILE"
}

ctld_pid() { pid_of "$CTLD_PIDFILE" slurmctld; }
slurmd_pid() { pid_of "$(slurmd_pidfile "$1")" slurmd; }
# Node -> when this run started its slurmd (scontrol's local time format, which sorts as text).
declare -A SLURMD_STARTED_AT=()

start_slurmctld() {
  if ctld_pid >/dev/null; then
    log "slurmctld: running (pid $(ctld_pid))"
    return 0
  fi
  log "starting slurmctld"
  rm -f -- "$CTLD_PIDFILE"
  slurmctld >>"$LOGS/slurmctld.start.log" 2>&1 9>&- ||
    fail_with_log "slurmctld did not start" "$LOGS/slurmctld.start.log" "$LOGS/slurmctld.log"
  local deadline=$((SECONDS + TIMEOUT)) answering written
  while :; do
    # A pid file that names no process running slurmctld: it exited. One that exists but holds no pid yet is being
    # written (the daemon creates it, then writes its pid): not an exit.
    written="$(tr -dc '0-9' 2>/dev/null <"$CTLD_PIDFILE")" || written=""
    ctld_pid >/dev/null || [[ -z $written ]] ||
      fail_with_log "slurmctld exited during its start" "$LOGS/slurmctld.start.log" "$LOGS/slurmctld.log"
    # Ask the controller that answers which state it keeps: another cluster's slurmctld on our port would answer
    # a plain ping just as well.
    answering="$(scontrol show config 2>/dev/null | awk '$1 == "StateSaveLocation" { print $3 }')" || true
    if [[ -n $answering ]] && ctld_pid >/dev/null; then
      [[ $answering == "$CTLD_STATE" ]] && break
      fail_with_log "port $CTLD_PORT is answered by another cluster's slurmctld (its state: $answering); stop it first" \
        "$LOGS/slurmctld.log"
    fi
    ((SECONDS < deadline)) || fail_with_log "slurmctld not answering after ${TIMEOUT}s" "$LOGS/slurmctld.log"
    sleep 0.1
  done
}

start_slurmd() {
  local node="$1"
  if slurmd_pid "$node" >/dev/null; then
    log "slurmd $node: running (pid $(slurmd_pid "$node"))"
    return 0
  fi
  log "starting slurmd -N $node"
  SLURMD_STARTED_AT[$node]="$(date +%Y-%m-%dT%H:%M:%S)"
  rm -f -- "$(slurmd_pidfile "$node")"
  install -d -m 0755 "$SPOOL/$node"
  slurmd -N "$node" >>"$LOGS/slurmd-$node.start.log" 2>&1 9>&- ||
    fail_with_log "slurmd -N $node did not start" "$LOGS/slurmd-$node.start.log" "$(slurmd_log "$node")"
}

# node_states: "node1 idle" lines (sinfo's long state, '*' appended when the node does not respond).
node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }

# Idle, or busy with jobs (already running, or recovered by a restarted controller); never unresponsive ('*'),
# down or drained.
readonly READY_STATES='idle|mixed|allocated|completing|idle\+completing|mixed\+completing|allocated\+completing'

# wait_nodes WANT: wait until every node is in a state matching the regex WANT, with a deadline.
wait_nodes() {
  local want="$1" deadline=$((SECONDS + TIMEOUT)) states n state registered resumed=""
  while :; do
    states="$(node_states)"
    local ok=1
    for n in "${NODES[@]}"; do
      state="$(awk -v n="$n" '$1 == n { print $2 }' <<<"$states")"
      if [[ $state =~ ^($want)$ ]]; then
        # A restarted controller reports the state it saved until the node registers again: for a slurmd started
        # by this run, wait for its own registration.
        [[ -z ${SLURMD_STARTED_AT[$n]:-} ]] && continue
        registered="$(scontrol show node -o "$n" 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2)" || true
        [[ $registered != None && ! $registered < ${SLURMD_STARTED_AT[$n]} ]] && continue
      fi
      ok=0
      # A node drained or downed by an earlier run (its slurmd killed under a job) is resumed once.
      if [[ $state =~ drain|down|fail ]] && [[ $state != *'*' ]] && [[ $resumed != *" $n "* ]] && is_root; then
        log "$n is '$state': resuming it"
        scontrol update NodeName="$n" State=RESUME || true
        resumed+=" $n "
      fi
    done
    ((ok)) && return 0
    if ((SECONDS >= deadline)); then
      local logs=("$LOGS/slurmctld.log")
      for n in "${NODES[@]}"; do logs+=("$(slurmd_log "$n")"); done
      fail_with_log "nodes not ready after ${TIMEOUT}s; sinfo says: $(tr '\n' ' ' <<<"$states")" "${logs[@]}"
    fi
    sleep 0.2
  done
}

all_daemons_up() {
  local n
  munge_works && ctld_pid >/dev/null || return 1
  for n in "${NODES[@]}"; do slurmd_pid "$n" >/dev/null || return 1; done
}

any_daemon_up() {
  local n
  ctld_pid >/dev/null && return 0
  for n in "${NODES[@]}"; do slurmd_pid "$n" >/dev/null && return 0; done
  return 1
}

# ---------------------------------------------------------------------------------------------------------------
# Commands.

# The lock is fd 9; every daemon is started with 9>&- or it would inherit the lock and hold it for its lifetime.
take_lock() {
  # Serialises concurrent start/stop on one state dir. A reader's fd suffices for flock, so a non-root user
  # may still run 'start' on a cluster that is already up.
  if is_root; then
    install -d -m 0755 "$STATE"
    exec 9>>"$LOCK"
  elif [[ -r $LOCK ]]; then
    exec 9<"$LOCK"
  else
    return 0
  fi
  flock -w "$TIMEOUT" 9 || die "another dev-cluster.sh holds $LOCK for more than ${TIMEOUT}s"
}

do_status() {
  local rc=0 n pid
  printf 'state dir: %s\nSLURM_CONF=%s\n' "$STATE" "$CONF"
  if pid="$(pid_of "$MUNGED_PIDFILE" munged)"; then
    printf '%-14s pid %-8s alive\n' munged "$pid"
  elif munge_works; then
    printf '%-14s %-12s alive (not started by this script)\n' munged -
  else
    printf '%-14s %-12s DOWN\n' munged -
    rc=3
  fi
  if pid="$(ctld_pid)"; then
    printf '%-14s pid %-8s alive\n' slurmctld "$pid"
  else
    printf '%-14s %-12s DOWN\n' slurmctld -
    rc=3
  fi
  for n in "${NODES[@]}"; do
    if pid="$(slurmd_pid "$n")"; then
      printf '%-14s pid %-8s alive\n' "slurmd $n" "$pid"
    else
      printf '%-14s %-12s DOWN\n' "slurmd $n" -
      rc=3
    fi
  done
  if ctld_pid >/dev/null; then
    sinfo || rc=3
    squeue || rc=3
  fi
  return "$rc"
}

do_stop() {
  local deadline n jobs rc=0
  if ctld_pid >/dev/null; then
    jobs="$(squeue -h -o '%A' 2>/dev/null | tr '\n' ' ')"
    if [[ -n ${jobs// /} ]]; then
      log "cancelling jobs: $jobs"
      # shellcheck disable=SC2086 # one word per job id
      scancel $jobs || true
      deadline=$((SECONDS + TIMEOUT))
      # Wait for completing jobs too: slurmd leaves running steps behind when stopped under them.
      while [[ -n $(squeue -h -o '%A' 2>/dev/null) ]]; do
        if ((SECONDS >= deadline)); then
          warn "jobs still present after ${TIMEOUT}s: $(squeue -h -o '%A:%T' | tr '\n' ' ')(their processes may survive)"
          rc=1
          break
        fi
        sleep 0.2
      done
    fi
  fi
  local -a daemons=("slurmctld:$CTLD_PIDFILE")
  for n in "${NODES[@]}"; do daemons+=("slurmd:$(slurmd_pidfile "$n")"); done
  stop_daemons "${daemons[@]}"
  # munged last: slurm daemons may still authenticate messages while they shut down.
  stop_daemons "munged:$MUNGED_PIDFILE"
  return "$rc"
}

do_start() {
  local t0 n new_conf
  t0="$(now)"
  ensure_installed
  new_conf="$(render_conf)"
  if all_daemons_up && [[ -r $CONF ]] && [[ $new_conf == "$(cat -- "$CONF")" ]]; then
    ensure_hosts
    install_etc_conf
    wait_nodes "$READY_STATES"
    log "already running with this config"
    do_status
    return 0
  fi
  need_root "starting the cluster"
  if any_daemon_up && [[ $new_conf != "$(cat -- "$CONF" 2>/dev/null)" ]]; then
    log "config changed: restarting the cluster"
    do_stop || warn "stop was not clean; starting anyway"
  fi
  install -d -m 0755 "$STATE" "$RUN" "$LOGS" "$SPOOL" "$CTLD_STATE"
  printf '%s\n' "$new_conf" >"$CONF.tmp"
  chmod 0644 "$CONF.tmp"
  mv -f -- "$CONF.tmp" "$CONF"
  ensure_hosts
  start_munged
  start_slurmctld
  for n in "${NODES[@]}"; do start_slurmd "$n"; done
  wait_nodes "$READY_STATES"
  # Only once the cluster is up: a failed start (say, a second state dir whose ports are taken) must not point
  # every user's plain sbatch at a cluster that does not exist.
  install_etc_conf
  log "cluster up in $(elapsed "$t0")s (SLURM_CONF=$CONF)"
  do_status
}

case "$cmd" in
start)
  take_lock
  do_start
  ;;
stop)
  take_lock
  if ! any_daemon_up && ! pid_of "$MUNGED_PIDFILE" munged >/dev/null; then
    log "not running (state dir $STATE)"
    exit 0
  fi
  need_root "stopping the cluster"
  if do_stop; then
    log "stopped"
  else
    die "stopped, but not cleanly (see warnings above)"
  fi
  ;;
status)
  do_status
  ;;
esac
