#!/usr/bin/env bash
# System packages the local stack and the tests need beyond Python: PostgreSQL's server binaries,
# bubblewrap (bwrap) for the node agents' workspace sandbox, OpenMPI for Horovod/MPI jobs,
# skopeo and umoci to unpack jobs' OCI images (debootstrap to build the tests' image), and
# Prometheus (prometheus, promtool) for the stack's metrics and the alerting rules' checks.
# Installs them with apt-get when they are missing and we may (root on Debian); otherwise says how.
# bubblewrap, OpenMPI, the image tools and Prometheus are optional: without them, agents build job
# workspaces as plain folders, MPI jobs cannot run (their end-to-end test is skipped), jobs with an
# image cannot run (the image tests are skipped), and the stack runs no Prometheus (the checks of
# deploy/prometheus are skipped).
set -euo pipefail

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

have_postgres() {
  command -v pg_ctl >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null
}

if ! command -v bwrap >/dev/null 2>&1; then
  if may_apt && echo "installing bubblewrap (apt-get install bubblewrap)" && apt_install bubblewrap; then
    :
  else
    echo "note: bubblewrap (bwrap) is not installed, so node agents will build job workspaces as plain" \
         "folders; install the 'bubblewrap' package for a real /workspace with read-only mounts" >&2
  fi
fi

if ! command -v mpicc >/dev/null 2>&1; then
  if may_apt && echo "installing OpenMPI (apt-get install openmpi-bin libopenmpi-dev)" \
      && apt_install openmpi-bin libopenmpi-dev; then
    :
  else
    echo "note: OpenMPI (mpirun, mpicc) is not installed, so Horovod/MPI jobs cannot run;" \
         "install 'openmpi-bin' and 'libopenmpi-dev'" >&2
  fi
fi

missing_image_tools=()
for tool in skopeo umoci debootstrap; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing_image_tools+=("$tool")
done
if [ "${#missing_image_tools[@]}" -gt 0 ]; then
  if may_apt && echo "installing image tools (apt-get install ${missing_image_tools[*]})" \
      && apt_install "${missing_image_tools[@]}"; then
    :
  else
    echo "note: ${missing_image_tools[*]} not installed, so jobs with an image cannot run on this node and" \
         "the image tests are skipped; install the 'skopeo', 'umoci' and 'debootstrap' packages" >&2
  fi
fi

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

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  running_before="$(pgrep -x prometheus 2>/dev/null | tr '\n' ' ' || true)"
  # --no-install-recommends: the recommended node exporter would be one more system service.
  if may_apt && echo "installing Prometheus (apt-get install --no-install-recommends prometheus)" \
      && apt_install --no-install-recommends prometheus; then
    stop_packaged_prometheus "$running_before"
  else
    echo "note: Prometheus (prometheus, promtool) is not installed, so the local stack runs no Prometheus" \
         "and the checks of deploy/prometheus are skipped; install the 'prometheus' package" >&2
  fi
fi

if have_postgres || [ -n "${DATABASE_URL:-}" ]; then
  exit 0
fi
if may_apt; then
  echo "installing PostgreSQL server binaries (apt-get install postgresql)"
  apt_install postgresql
else
  echo "PostgreSQL server binaries are missing: install the 'postgresql' package, or set DATABASE_URL" >&2
  exit 1
fi
