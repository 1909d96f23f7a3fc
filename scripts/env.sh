# Sourced by scripts/install.sh, scripts/app.sh and .ci/run: picks the Python to install into as $PY.
# - inside an active virtual environment: that one;
# - a system Python that refuses pip (PEP 668, e.g. Debian's /usr/bin/python3): a .venv here;
# - otherwise (pyenv, conda, a container image's Python): python3 itself.
if [ -n "${VIRTUAL_ENV:-}" ]; then
  PY=python
elif python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv 2>/dev/null || {
      if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
      $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
      python3 -m venv .venv
    }
  fi
  PY=.venv/bin/python
else
  PY=python3
fi
export PY
