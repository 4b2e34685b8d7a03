#!/usr/bin/env bash
# The project's one test command: installs system servers if missing, builds
# .venv, lints, checks the layers and the types, then runs pytest with any extra
# arguments passed through.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

SUDO=()
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
fi

apt_updated=0
apt_install() {
    if [ "$apt_updated" -eq 0 ]; then
        "${SUDO[@]}" apt-get update -q
        apt_updated=1
    fi
    # Keep apt from starting system-wide services (tests start their own).
    local policy=/usr/sbin/policy-rc.d created=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" >/dev/null
        "${SUDO[@]}" chmod +x "$policy"
        created=1
    fi
    local rc=0
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" || rc=$?
    if [ "$created" -eq 1 ]; then
        "${SUDO[@]}" rm -f "$policy"
    fi
    return "$rc"
}

pg_bin_dir() {
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -n "$d" ] && [ -x "$d/initdb" ]; then
        echo "$d"
    fi
}

if ! command -v redis-server >/dev/null 2>&1; then
    apt_install redis-server
fi

# The dashboard's tests drive Debian's chromium (with Playwright, from PyPI).
if ! command -v chromium >/dev/null 2>&1; then
    apt_install chromium
fi

# The MySQL store's tests run on Debian's MariaDB (tests/_servers.py starts its own).
if ! command -v mariadbd >/dev/null 2>&1 && [ ! -x /usr/sbin/mariadbd ]; then
    apt_install mariadb-server
fi

# mysqlclient (Django's MySQL backend, in the test extra) has no Linux wheel: pip
# builds it against MariaDB's client library, found by pkg-config.
if ! { command -v pkg-config >/dev/null 2>&1 && pkg-config --exists mariadb; }; then
    apt_install libmariadb-dev pkg-config
fi

if ! command -v initdb >/dev/null 2>&1; then
    if [ -z "$(pg_bin_dir)" ]; then
        apt_install postgresql
    fi
    PG_BIN=$(pg_bin_dir)
    if [ -n "$PG_BIN" ]; then
        export PATH="$PG_BIN:$PATH"
    fi
fi

if [ ! -x .venv/bin/python ]; then
    PYTHON=$(command -v python3.11 || command -v python3)
    if ! "$PYTHON" -m venv .venv; then
        # Debian ships ensurepip separately.
        rm -rf .venv
        py_ver=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
        apt_install "python${py_ver}-venv"
        "$PYTHON" -m venv .venv
    fi
fi

.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[all,test]'

lint_paths=(src tests)
if [ -d bench ]; then
    lint_paths+=(bench)
fi
.venv/bin/python -m ruff check "${lint_paths[@]}"
.venv/bin/python -m ruff format --check --quiet "${lint_paths[@]}"
# The layers (docs/architecture.md), and shared code under real names.
.venv/bin/lint-imports --no-cache --no-logo >/dev/null || .venv/bin/lint-imports --no-cache --no-logo
.venv/bin/python scripts/private_names.py
# The type checker on src ([tool.mypy] in pyproject.toml).
.venv/bin/python -m mypy

exec .venv/bin/python -m pytest "$@"
