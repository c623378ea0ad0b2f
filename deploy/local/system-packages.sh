#!/usr/bin/env bash
# System packages the local stack and the tests need beyond Python: PostgreSQL's server binaries.
# Installs them with apt-get when they are missing and we may (root on Debian); otherwise says how.
set -euo pipefail

have_postgres() {
  command -v pg_ctl >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null
}

if have_postgres || [ -n "${DATABASE_URL:-}" ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing PostgreSQL server binaries (apt-get install postgresql)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
else
  echo "PostgreSQL server binaries are missing: install the 'postgresql' package, or set DATABASE_URL" >&2
  exit 1
fi
