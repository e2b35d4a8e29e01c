#!/bin/sh
# Installs Debian's `prometheus` package (the server and `promtool`) when either is missing, the way the project installs
# its other dependencies: `make test` runs this first. Idempotent and quiet; never leaves a Prometheus service running
# (the package's own service is kept from starting; tests start their own server on a free port).
# Where it cannot install (no apt-get, not root), it says so and exits 0: tests/e2e/test_prometheus.py then skips with
# that reason.
set -u
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-prometheus: no apt-get here; install Prometheus (prometheus + promtool) yourself to run its tests" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ensure-prometheus: not root and no passwordless sudo; install the prometheus package to run its tests" >&2
        exit 0
    fi
fi
# Keep the package's service from starting (it would take port 9090, the control plane's default metrics port).
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=""
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null && $SUDO chmod +x "$POLICY" && ADDED_POLICY=1
fi
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends prometheus; } >"$log" 2>&1; then
    echo "ensure-prometheus: apt-get install prometheus failed (its tests will skip):" >&2
    tail -5 "$log" >&2
fi
rm -f "$log"
if [ -n "$ADDED_POLICY" ]; then
    $SUDO rm -f "$POLICY"
fi
# Whatever the init system did, nothing of the package's own is left running.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
exit 0
