#!/bin/sh
# Install the odmoe agent on this box and enroll it with the control plane.
#
#   curl -fsSL SERVER/agent/install.sh | sh -s -- --server SERVER --token TOKEN [options]
#
# Options:
#   --server URL     the control plane (default: the one that served this script)
#   --token T        a join token from the console (required)
#   --name N         this node's name (default: the host name)
#   --dir DIR        where the venv and the agent's state live (default: ~/.local/share/odmoe-agent)
#   --no-service     do not install a systemd unit; print how to run the agent instead
# Environment: PYTHON (default python3, 3.11 or newer), ODMOE_PIP_ARGS (extra pip arguments),
#   ODMOE_JOIN_TOKEN (the join token, instead of --token: kept out of the process list).
set -eu

SERVER="@SERVER@"
AGENT_SHA256="@AGENT_SHA256@"  # of the agent package this script was served with
TOKEN="${ODMOE_JOIN_TOKEN:-}"
NAME="$(hostname)"
DIR="${HOME}/.local/share/odmoe-agent"
SERVICE="auto"
PYTHON="${PYTHON:-python3}"

die() { echo "odmoe install: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --server) [ $# -ge 2 ] || die "--server needs a value"; SERVER="$2"; shift 2 ;;
        --token) [ $# -ge 2 ] || die "--token needs a value"; TOKEN="$2"; shift 2 ;;
        --name) [ $# -ge 2 ] || die "--name needs a value"; NAME="$2"; shift 2 ;;
        --dir) [ $# -ge 2 ] || die "--dir needs a value"; DIR="$2"; shift 2 ;;
        --no-service) SERVICE="no"; shift ;;
        -h|--help) sed -n '2,14p' "$0" 2>/dev/null || true; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

[ -n "$TOKEN" ] || die "--token is required (or ODMOE_JOIN_TOKEN): create a join token in the console (Enroll)"
case "$SERVER" in http://*|https://*) ;; *) die "--server must be an http(s) URL, got '$SERVER'" ;; esac
SERVER="${SERVER%/}"
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: install Python 3.11 or newer"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "Python 3.11 or newer is needed"

echo "odmoe install: creating a virtual environment in $DIR/venv"
mkdir -p "$DIR"
"$PYTHON" -m venv "$DIR/venv" || die "cannot create a venv (Debian: apt install python3-venv)"
echo "odmoe install: downloading the agent package from $SERVER"
PACKAGE="$DIR/odmoe-agent.tar.gz"
"$DIR/venv/bin/python" - "$SERVER/agent/odmoe-agent.tar.gz" "$PACKAGE" "$AGENT_SHA256" <<'PY' || die "the agent package did not download or does not match the sha256 this script was served with"
import hashlib, sys, urllib.request
url, path, want = sys.argv[1:]
data = urllib.request.urlopen(url, timeout=120).read()
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit(f"odmoe install: {url} has sha256 {got}, expected {want}")
open(path, "wb").write(data)
PY
echo "odmoe install: installing the agent and the runtime (this takes a few minutes)"
# shellcheck disable=SC2086  # ODMOE_PIP_ARGS is a list of arguments
"$DIR/venv/bin/python" -m pip install --quiet ${ODMOE_PIP_ARGS:-} "$PACKAGE"

echo "odmoe install: enrolling $NAME"
"$DIR/venv/bin/python" -m agent --server "$SERVER" --token "$TOKEN" --name "$NAME" \
    --state-dir "$DIR/state" --enroll-only

RUN="$DIR/venv/bin/python -m agent --server $SERVER --state-dir $DIR/state"
if [ "$SERVICE" = "auto" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    if [ "$(id -u)" = "0" ]; then
        UNIT_DIR=/etc/systemd/system; CTL="systemctl"; WANTED=multi-user.target
    else
        UNIT_DIR="$HOME/.config/systemd/user"; CTL="systemctl --user"; WANTED=default.target
    fi
    mkdir -p "$UNIT_DIR"
    cat > "$UNIT_DIR/odmoe-agent.service" <<UNIT
[Unit]
Description=odmoe agent (node $NAME of $SERVER)
After=network-online.target
Wants=network-online.target

[Service]
ExecStart=$RUN
Restart=always
RestartSec=5

[Install]
WantedBy=$WANTED
UNIT
    $CTL daemon-reload
    $CTL enable --now odmoe-agent.service
    echo "odmoe install: done; the agent runs as the systemd unit odmoe-agent ($CTL status odmoe-agent)"
else
    echo "odmoe install: done; start the agent with:"
    echo "    $RUN"
fi
