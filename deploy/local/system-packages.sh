#!/usr/bin/env bash
# System packages the local stack and the tests need beyond Python: PostgreSQL's server binaries,
# bubblewrap (bwrap) for the node agents' workspace sandbox, and OpenMPI for Horovod/MPI jobs.
# Installs them with apt-get when they are missing and we may (root on Debian); otherwise says how.
# bubblewrap and OpenMPI are optional: without them, agents build job workspaces as plain folders
# and MPI jobs cannot run (their end-to-end test is skipped).
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
