#!/usr/bin/env bash
# Install the headless browser the dashboard's tests drive: Debian's Chromium and its WebDriver
# (packages `chromium` and `chromium-driver`: /usr/bin/chromium, /usr/bin/chromedriver).
#
# Idempotent: when both binaries are there (and run), nothing is installed. Otherwise, as root on
# a Debian/Ubuntu machine, runs `apt-get update` then `apt-get install -y --no-install-recommends
# chromium chromium-driver` (DEBIAN_FRONTEND=noninteractive; a few minutes the first time). CI runs
# it as root on a fresh machine through the tests' session fixture (tests/test_dashboard.py).
#
# Exit codes: 0 the browser and driver are ready (their versions are printed); 3 they cannot be
# installed here (not root, no apt-get, or apt failed), with the reason on standard error.
set -uo pipefail

BROWSER=${STAGETREE_CHROMIUM:-/usr/bin/chromium}
DRIVER=${STAGETREE_CHROMEDRIVER:-/usr/bin/chromedriver}

ready() {
    [ -x "$BROWSER" ] && [ -x "$DRIVER" ] && "$DRIVER" --version >/dev/null 2>&1
}

if ready; then
    "$DRIVER" --version
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "browser.sh: $BROWSER or $DRIVER is missing and this user is not root, so apt-get cannot install" \
         "chromium and chromium-driver (run: sudo apt-get install chromium chromium-driver)" >&2
    exit 3
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "browser.sh: $BROWSER or $DRIVER is missing and there is no apt-get on this machine" \
         "(install Chromium and its chromedriver, or set STAGETREE_CHROMIUM / STAGETREE_CHROMEDRIVER)" >&2
    exit 3
fi
export DEBIAN_FRONTEND=noninteractive
if ! out=$(apt-get update 2>&1); then
    echo "browser.sh: apt-get update failed:" >&2
    echo "$out" | tail -n 15 >&2
    exit 3
fi
if ! out=$(apt-get install -y --no-install-recommends chromium chromium-driver 2>&1); then
    echo "browser.sh: apt-get install chromium chromium-driver failed:" >&2
    echo "$out" | tail -n 15 >&2
    exit 3
fi
if ! ready; then
    echo "browser.sh: installed chromium and chromium-driver, but $BROWSER or $DRIVER is still missing" >&2
    exit 3
fi
"$DRIVER" --version
