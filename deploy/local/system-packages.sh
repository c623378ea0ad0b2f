#!/usr/bin/env bash
# System packages the local stack and the tests need beyond Python, named with the versions the tests were
# run with in deploy/lock/debian.txt: PostgreSQL's server binaries, bubblewrap (bwrap) for the node agents'
# job sandbox, OpenMPI for Horovod/MPI jobs, skopeo, umoci and debootstrap for jobs' OCI images, and
# Prometheus (prometheus, promtool) for the stack's metrics and the alerting rules' checks, and Chromium with
# chromedriver for the console's browser tests.
# Installs the missing ones with apt-get when we may (root on Debian); otherwise says how. Then says which
# installed versions differ from the tested ones.
# All but PostgreSQL are optional: without bubblewrap, agents build job workspaces as plain folders; without
# OpenMPI, MPI jobs cannot run (their end-to-end test is skipped); without the image tools, jobs with an
# image cannot run (the image tests are skipped); without Prometheus, the stack runs none (the checks of
# deploy/prometheus are skipped).
set -euo pipefail
LIST="$(dirname "$0")/../lock/debian.txt"

# The packages of one group of the list.
packages() {
  awk -v group="$1" '$1 == group { print $2 }' "$LIST"
}

may_apt() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1
}

apt_updated=""
# Another apt-get at work (a machine's own updates) holds dpkg's lock for a while: wait for it rather than
# going on without the packages. The package lists' lock is not covered by the timeout: the update is
# tried again for a minute, then the install goes on with the lists there are.
APT_WAIT=(-o DPkg::Lock::Timeout=300)
apt_install() {
  local tries=0
  while [ -z "$apt_updated" ] && [ "$tries" -lt 30 ]; do
    if apt-get "${APT_WAIT[@]}" update -qq; then apt_updated=1; else tries=$((tries + 1)); sleep 2; fi
  done
  apt_updated=${apt_updated:-tried}  # one minute of tries is enough for every package
  DEBIAN_FRONTEND=noninteractive apt-get "${APT_WAIT[@]}" install -y -qq "$@" >/dev/null
}

# install_group GROUP NOTE: installs the group's packages unless `present` (a command) says they are there.
install_group() {
  local group="$1" note="$2" present="$3"
  local names
  names="$(packages "$group" | tr '\n' ' ')"
  if eval "$present"; then return 0; fi
  if may_apt && echo "installing $group packages (apt-get install ${names% })" && apt_install $names; then
    return 0
  fi
  echo "note: ${names% } not installed: $note; install them with apt-get (deploy/lock/debian.txt)" >&2
  return 1
}

have() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || return 1
  done
}

have_postgres() {
  command -v pg_ctl >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null
}

# Debian's package starts (and enables) a system-wide Prometheus on port 9090 as it installs. The stack
# runs its own, on its own port, only when asked: stop and disable the packaged service at once, and end
# the daemon the install started (one running /usr/bin/prometheus that was not there before the install).
stop_packaged_prometheus() {
  local before="$1" pid
  if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  else
    if command -v service >/dev/null 2>&1; then service prometheus stop >/dev/null 2>&1 || true; fi
    if command -v update-rc.d >/dev/null 2>&1; then update-rc.d prometheus disable >/dev/null 2>&1 || true; fi
  fi
  for pid in $(pgrep -x prometheus 2>/dev/null || true); do
    case " $before " in *" $pid "*) continue ;; esac
    if [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = /usr/bin/prometheus ]; then
      kill "$pid" 2>/dev/null || true
    fi
  done
}

# Which installed packages are not at the tested version (a missing one was named above).
report_versions() {
  command -v dpkg-query >/dev/null 2>&1 || return 0
  local group name tested installed differ=0
  while read -r group name tested _; do
    case "$group" in ''|'#'*) continue ;; esac
    installed="$(dpkg-query -W -f '${Version}' "$name" 2>/dev/null || true)"
    if [ -n "$installed" ] && [ "$installed" != "$tested" ]; then
      [ "$differ" = 1 ] || echo "note: these Debian packages differ from the versions the tests were run with" \
                                "(deploy/lock/debian.txt); the tests may behave differently:" >&2
      differ=1
      printf '  %-16s %-26s tested with %s\n' "$name" "$installed" "$tested" >&2
    fi
  done < "$LIST"
}

install_group python "make install makes .venv with python3 (a CPython built without profile-guided optimization \
takes the services and agents about a fifth more CPU)" "[ -x /usr/bin/python3.11 ] && /usr/bin/python3.11 -c 'import ensurepip, venv'" \
  || true
install_group sandbox "node agents will build job workspaces as plain folders, without a sandbox" \
  "have bwrap" || true
install_group dropper "root agents drop each job to its user with setpriv, and start sandboxes with the system's \
bwrap: about 1.5 ms of CPU a job more" "have musl-gcc patch && [ -f /usr/include/linux/capability.h ]" || true
install_group mpi "Horovod/MPI jobs cannot run" "have mpirun mpicc" || true
install_group images "jobs with an image cannot run on this node and the image tests are skipped" \
  "have skopeo umoci debootstrap" || true
install_group browser "the console's browser tests cannot run (CI fails them rather than skip)" \
  "have chromium chromedriver && fc-list :lang=zh | grep -q ." || true

running_before="$(pgrep -x prometheus 2>/dev/null | tr '\n' ' ' || true)"
if ! have prometheus promtool; then
  # --no-install-recommends: the recommended node exporter would be one more system service.
  if may_apt && echo "installing metrics packages (apt-get install --no-install-recommends prometheus)" \
      && apt_install --no-install-recommends $(packages metrics); then
    stop_packaged_prometheus "$running_before"
  else
    echo "note: prometheus not installed: the local stack runs no Prometheus and the checks of deploy/prometheus" \
         "are skipped; install it with apt-get (deploy/lock/debian.txt)" >&2
  fi
fi

if ! have_postgres && [ -z "${DATABASE_URL:-}" ]; then
  if ! install_group database "the stack and the tests need PostgreSQL, or DATABASE_URL" "have_postgres"; then
    exit 1
  fi
fi
report_versions
