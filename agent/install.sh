#!/bin/sh
# Install the odmoe agent on this box and enroll it with the control plane; run it again to upgrade.
#
#   curl -fsSL [--pinnedpubkey PIN -k] SERVER/agent/install.sh | ODMOE_JOIN_TOKEN=T sh -s -- --server SERVER
#
# Options:
#   --server URL     the control plane, https (default: the one that served this script)
#   --token T        a join token from the console (first install only: an upgrade keeps the credential)
#   --name N         this node's name (default: the host name)
#   --dir DIR        where the venv and the agent's state live (default: ~/.local/share/odmoe-agent)
#   --no-service     do not install a systemd unit; print how to run the agent instead
#   --insecure       allow a plain http server off this box (a lab network: everything travels in clear)
#   --dry-run        print what would be done, change nothing
#   --uninstall      stop and remove the agent's unit and venv (the credential stays unless --purge)
#   --purge          with --uninstall: remove the agent's state (its node credential, shards) too
# Environment: PYTHON (default python3, 3.11 or newer), ODMOE_PIP_ARGS (extra pip arguments),
#   ODMOE_JOIN_TOKEN (the join token, instead of --token: kept out of the process list).
set -eu

SERVER="@SERVER@"
PIN="@TLS_PIN@"                # the server's key (sha256//...; curl --pinnedpubkey); empty: CAs
case "$PIN" in @*) PIN="" ;; esac  # not served by a control plane: no pin
WHEEL="@AGENT_WHEEL@"          # the agent package this script was served with
AGENT_SHA256="@AGENT_SHA256@"  # and its sha256
TOKEN="${ODMOE_JOIN_TOKEN:-}"
NAME="$(hostname)"
DIR="${HOME}/.local/share/odmoe-agent"
SERVICE="auto"
PYTHON="${PYTHON:-python3}"
DRY_RUN="no"
ACTION="install"
PURGE="no"
INSECURE=""

die() { echo "odmoe install: error: $*" >&2; exit 1; }
say() { echo "odmoe install: $*"; }
# Run a command, or with --dry-run only say it.
run() { if [ "$DRY_RUN" = "yes" ]; then echo "odmoe install: would run: $*"; else "$@"; fi; }

while [ $# -gt 0 ]; do
    case "$1" in
        --server) [ $# -ge 2 ] || die "--server needs a value"; SERVER="$2"; shift 2 ;;
        --token) [ $# -ge 2 ] || die "--token needs a value"; TOKEN="$2"; shift 2 ;;
        --name) [ $# -ge 2 ] || die "--name needs a value"; NAME="$2"; shift 2 ;;
        --dir) [ $# -ge 2 ] || die "--dir needs a value"; DIR="$2"; shift 2 ;;
        --no-service) SERVICE="no"; shift ;;
        --insecure) INSECURE="--insecure"; shift ;;
        --dry-run) DRY_RUN="yes"; shift ;;
        --uninstall) ACTION="uninstall"; shift ;;
        --purge) PURGE="yes"; shift ;;
        -h|--help) sed -n '2,17p' "$0" 2>/dev/null || true; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
[ "$PURGE" = "no" ] || [ "$ACTION" = "uninstall" ] || die "--purge goes with --uninstall"

# Where a systemd unit goes for this user, and how to drive it (nothing when there is no systemd).
UNIT_DIR=""; CTL=""; WANTED=""
if [ "$SERVICE" = "auto" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    if [ "$(id -u)" = "0" ]; then
        UNIT_DIR=/etc/systemd/system; CTL="systemctl"; WANTED=multi-user.target
    else
        UNIT_DIR="$HOME/.config/systemd/user"; CTL="systemctl --user"; WANTED=default.target
    fi
fi
UNIT="odmoe-agent.service"

if [ "$ACTION" = "uninstall" ]; then
    if [ -n "$UNIT_DIR" ] && [ -f "$UNIT_DIR/$UNIT" ]; then
        say "stopping and removing the systemd unit $UNIT"
        # shellcheck disable=SC2086  # CTL is a command and its options
        run $CTL disable --now "$UNIT" || say "the unit would not stop cleanly; removing it anyway"
        run rm -f "$UNIT_DIR/$UNIT"
        # shellcheck disable=SC2086
        run $CTL daemon-reload
    fi
    if [ -d "$DIR/venv" ]; then say "removing the agent's venv $DIR/venv"; run rm -rf "$DIR/venv"; fi
    run rm -f "$DIR"/*.whl
    if [ "$PURGE" = "yes" ]; then
        say "removing the agent's state $DIR/state (its node credential and shards)"
        run rm -rf "$DIR/state"
        run rmdir "$DIR" 2>/dev/null || true
    elif [ -d "$DIR/state" ]; then
        say "kept $DIR/state (the node credential): --uninstall --purge removes it; the console can revoke the node"
    fi
    say "uninstalled"
    exit 0
fi

case "$SERVER" in http://*|https://*) ;; *) die "--server must be an http(s) URL, got '$SERVER'" ;; esac
SERVER="${SERVER%/}"
UPGRADE="no"
[ -f "$DIR/state/node.json" ] && UPGRADE="yes"
[ -n "$TOKEN" ] || [ "$UPGRADE" = "yes" ] || \
    die "--token is required (or ODMOE_JOIN_TOKEN): create a join token in the console (Enroll)"

# The server's host: after the scheme and any user, before the port and path ([::1] keeps its brackets).
HOST="${SERVER#*://}"; HOST="${HOST%%/*}"; HOST="${HOST##*@}"
case "$HOST" in \[*) HOST="${HOST%%]*}]" ;; *) HOST="${HOST%%:*}" ;; esac
LOOPBACK="no"
case "$HOST" in
    localhost|\[::1\]) LOOPBACK="yes" ;;
    *[!0-9.]*) ;;  # a name (127.example.com is not this box)
    127.*) LOOPBACK="yes" ;;
esac
case "$SERVER" in https://*) ;; *) PIN="" ;; esac  # a pin is for TLS
if [ "${SERVER%%://*}" = "http" ] && [ "$LOOPBACK" = "no" ]; then
    [ -n "$INSECURE" ] || die "refusing plain http to $HOST: off this box the control plane is reached over https \
(the join token, the node credential, role specs with secret keys, prompts and shards would travel in clear); \
use https://, or add --insecure on a lab network you trust"
    say "WARNING: --insecure: plain http to $HOST: the join token, the node credential, role specs with secret keys, \
prompts and shards travel in clear"
fi
# curl as the one-liner ran it: pinned to the server's key when it has a pin (-k drops only the CA check the pin replaces).
fetch() {  # fetch URL FILE
    if [ -n "$PIN" ]; then
        curl -fsSL --pinnedpubkey "$PIN" -k -o "$2" "$1"
    else
        curl -fsSL -o "$2" "$1"
    fi
}
PIN_ARGS=""
[ -z "$PIN" ] || PIN_ARGS="--pin $PIN"

command -v curl >/dev/null 2>&1 || die "curl not found: install curl (Debian/Ubuntu: apt install curl)"
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found: install Python 3.11 or newer (or set PYTHON)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "$PYTHON is older than 3.11: install Python 3.11 or newer"
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || \
    die "$PYTHON has no venv module (Debian/Ubuntu: apt install python3-venv)"

if [ "$UPGRADE" = "yes" ]; then
    say "upgrading the agent in $DIR in place (its node credential is kept)"
else
    say "installing the agent in $DIR"
fi
[ "$DRY_RUN" = "no" ] || say "dry run: nothing is changed"
if [ -x "$DIR/venv/bin/python" ]; then
    say "reusing the virtual environment $DIR/venv"
else
    say "creating a virtual environment in $DIR/venv"
    run mkdir -p "$DIR"
    run "$PYTHON" -m venv "$DIR/venv" || die "cannot create a venv in $DIR/venv (Debian/Ubuntu: apt install python3-venv)"
fi
VPY="$DIR/venv/bin/python"

PACKAGE="$DIR/$WHEEL"
say "downloading the agent package $WHEEL from $SERVER (sha256 $AGENT_SHA256${PIN:+, key $PIN})"
if [ "$DRY_RUN" = "no" ]; then
    rm -f "$PACKAGE.part"
    fetch "$SERVER/agent/$WHEEL" "$PACKAGE.part" || die "the agent package did not download from $SERVER (curl's reason is above)"
    "$VPY" - "$PACKAGE.part" "$AGENT_SHA256" <<'PY' || { rm -f "$PACKAGE.part"; die "the agent package does not match the sha256 this script was served with"; }
import hashlib, sys
path, want = sys.argv[1:]
got = hashlib.sha256(open(path, "rb").read()).hexdigest()
if got != want:
    sys.exit(f"odmoe install: the downloaded package has sha256 {got}, expected {want}")
PY
    mv "$PACKAGE.part" "$PACKAGE"
fi
say "installing the agent and the runtime with their dependencies (the first time takes a few minutes)"
# shellcheck disable=SC2086  # ODMOE_PIP_ARGS is a list of arguments
run "$VPY" -m pip install --quiet --disable-pip-version-check ${ODMOE_PIP_ARGS:-} "$PACKAGE" || \
    die "pip could not install the agent (its messages are above; ODMOE_PIP_ARGS passes pip options, e.g. --index-url)"
# The same version may hold other code: put this package's files in place whatever pip thinks is there.
run "$VPY" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$PACKAGE" || \
    die "pip could not put the agent's own files in place (its messages are above)"

say "checking this box (python -m agent doctor)"
# shellcheck disable=SC2086  # PIN_ARGS and INSECURE are options or nothing
run "$VPY" -m agent doctor --server "$SERVER" --state-dir "$DIR/state" $PIN_ARGS $INSECURE || \
    say "the doctor found problems (above): the box enrolls, but is given no role until they are fixed"

if [ "$UPGRADE" = "yes" ]; then
    say "checking the stored node credential with $SERVER"
    # With a pin (this script's, which curl checked), a box whose server changed its key follows it.
    # shellcheck disable=SC2086
    run "$VPY" -m agent --server "$SERVER" --state-dir "$DIR/state" --enroll-only $PIN_ARGS $INSECURE || \
        die "the stored credential in $DIR/state is not accepted by $SERVER (revoked? --uninstall --purge, then install with a new token)"
else
    say "enrolling $NAME"
    ODMOE_JOIN_TOKEN="$TOKEN"; export ODMOE_JOIN_TOKEN  # the agent reads it there: not on a command line
    # shellcheck disable=SC2086
    run "$VPY" -m agent --server "$SERVER" --name "$NAME" --state-dir "$DIR/state" --enroll-only $PIN_ARGS $INSECURE || \
        die "enrollment failed (the reason is above)"
fi

RUN="$VPY -m agent --server $SERVER --state-dir $DIR/state${INSECURE:+ $INSECURE}"
if [ -n "$UNIT_DIR" ]; then
    say "installing the systemd unit $UNIT_DIR/$UNIT"
    if [ "$DRY_RUN" = "no" ]; then
        mkdir -p "$UNIT_DIR"
        cat > "$UNIT_DIR/$UNIT" <<UNIT
[Unit]
Description=odmoe agent (node $NAME of $SERVER)
After=network-online.target
Wants=network-online.target

[Service]
ExecStart=$RUN
Restart=always
RestartSec=5
# 3: the control plane refused the agent (credential revoked, protocol too old); 2: refused
# arguments (plain http off the box without --insecure): a restart cannot help
RestartPreventExitStatus=2 3

[Install]
WantedBy=$WANTED
UNIT
    fi
    # shellcheck disable=SC2086  # CTL is a command and its options
    run $CTL daemon-reload
    # shellcheck disable=SC2086
    run $CTL enable "$UNIT"
    # shellcheck disable=SC2086
    run $CTL restart "$UNIT"  # an upgrade starts the new code
    say "done; the agent runs as the systemd unit odmoe-agent ($CTL status odmoe-agent)"
else
    say "done; start the agent with:"
    echo "    $RUN"
fi
