#!/usr/bin/env bash
# What tests/test_app.py's browser test needs on a fresh Debian/Ubuntu machine: the distribution's
# chromium, which Playwright drives through executable_path=/usr/bin/chromium (`playwright install`
# is never run: it downloads browsers), and the demo's Python packages when they are missing.
# --no-install-recommends: chromium alone, not the ~160 recommended packages (avahi, CUPS helpers, ...)
# a desktop wants (Debian 12, simulated on an empty system: 239 packages instead of 399). Headless
# rendering still has a font: libfontconfig1 -> fontconfig-config depends on fonts-dejavu-core. The test
# runs it --headless --no-sandbox --disable-gpu, so the recommended chromium-sandbox and system EGL/GLES
# are not needed (chromium-common ships its own libEGL/libGLESv2 and SwiftShader).
set -euo pipefail

if [ ! -x /usr/bin/chromium ]; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    echo "installing Debian's chromium (apt-get, without recommended packages)..."
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium
fi
python -c "import gradio, gradio_client, playwright" 2>/dev/null || python -m pip install -q "gradio>=6" gradio_client playwright
/usr/bin/chromium --version
