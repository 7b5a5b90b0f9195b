#!/usr/bin/env bash
# Debian's Chromium for the playground's browser tests (tests/server/test_playground.py), which drive it
# with Playwright's library (no browser download). Idempotent: nothing to do once it is there.
# `make test` runs it; `make run` does not need a browser.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: no apt-get here; install Chromium yourself (the browser tests skip without it)" >&2
    exit 0
fi
sudo=()
[[ "$(id -u)" == "0" ]] || sudo=(sudo)
echo "install_browser: installing Debian's chromium for the browser tests (once)"
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends chromium >/dev/null
chromium --version
