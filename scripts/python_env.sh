#!/usr/bin/env bash
# Prints the Python interpreter the project's scripts install into and run (messages go to stderr).
#
# - Inside an active virtual environment (VIRTUAL_ENV set): that environment's python.
# - Otherwise the project's .venv, created on first use with `python3 -m venv --system-site-packages`:
#   installs then go into .venv even where the system Python refuses `pip install` (PEP 668: an
#   EXTERNALLY-MANAGED file in its stdlib folder, which pip honours outside a virtual environment
#   only), while packages the base interpreter already has (a preinstalled torch) are reused, not
#   downloaded again. Where ensurepip is missing (Debian/Ubuntu without python3-venv) the venv is
#   made --without-pip and uses the base interpreter's pip, if it has one.
# - Where no venv can be made: the base interpreter itself, with one line saying so.
#
# Inputs: PYTHON (the base interpreter, default python3), GRAPHRUNNER_VENV (default <repo>/.venv).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
base="${PYTHON:-python3}"
venv="${GRAPHRUNNER_VENV:-$root/.venv}"

if [[ -n "${VIRTUAL_ENV:-}" ]]; then
  if [[ -x "$VIRTUAL_ENV/bin/python" ]]; then echo "$VIRTUAL_ENV/bin/python"; else echo "$base"; fi
  exit 0
fi

usable() {  # a venv whose python runs and has pip (its own or the base interpreter's)
  [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -m pip --version >/dev/null 2>&1
}

if usable; then
  echo "$venv/bin/python"
  exit 0
fi
if [[ -e "$venv" && ! -f "$venv/pyvenv.cfg" ]]; then
  echo "graphrunner: $venv exists but is not a virtual environment; using $base itself" >&2
  echo "$base"
  exit 0
fi
rm -rf "$venv"  # a broken or half-made venv of ours
for flags in "--system-site-packages" "--system-site-packages --without-pip"; do
  # shellcheck disable=SC2086
  if "$base" -m venv $flags "$venv" >/dev/null 2>&1 && usable; then
    echo "graphrunner: created $venv ($base -m venv $flags)" >&2
    echo "$venv/bin/python"
    exit 0
  fi
  rm -rf "$venv"
done

stdlib="$("$base" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))' 2>/dev/null || true)"
if [[ -n "$stdlib" && -f "$stdlib/EXTERNALLY-MANAGED" ]]; then
  echo "graphrunner: cannot create $venv ($base -m venv failed: on Debian/Ubuntu apt install python3-venv); using $base itself, whose pip refuses installs (externally managed, PEP 668): activate a virtual environment and run this again" >&2
else
  echo "graphrunner: cannot create $venv ($base -m venv failed: on Debian/Ubuntu apt install python3-venv); installing into $base itself" >&2
fi
echo "$base"
