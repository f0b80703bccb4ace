#!/usr/bin/env bash
# What tests/test_app.py's browser test needs on a fresh Debian/Ubuntu machine: the distribution's
# chromium, which Playwright drives through executable_path=/usr/bin/chromium (`playwright install`
# is never run: it downloads browsers), and the demo's Python packages when they are missing.
set -euo pipefail

if [ ! -x /usr/bin/chromium ]; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
fi
python -c "import gradio, gradio_client, playwright" 2>/dev/null || python -m pip install -q "gradio>=6" gradio_client playwright
/usr/bin/chromium --version
