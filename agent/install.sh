#!/bin/sh
# Install the odmoe agent on this box and enroll it with the control plane; run it again to upgrade.
#
#   curl -fsSL [--pinnedpubkey PIN -k] SERVER/agent/install.sh | ODMOE_JOIN_TOKEN=T sh -s -- --server SERVER
#
# As root, the agent (and so every runtime role it starts) runs as an unprivileged system user
# under a sandboxed systemd unit; as another user, as that user's own unit.
#
# Options:
#   --server URL     the control plane, https (default: the one that served this script)
#   --token T        a join token from the console (first install only: an upgrade keeps the credential)
#   --name N         this node's name (default: the host name)
#   --dir DIR        where the venv and the agent's state live (default: ~/.local/share/odmoe-agent;
#                    as root: /var/lib/odmoe-agent)
#   --user U         as root: the system user the agent and its roles run as (default: odmoe-agent,
#                    created if missing, in the groups video and render where they exist)
#   --no-service     do not install a systemd unit; print how to run the agent instead
#   --unit-dir D     write the systemd unit into D and leave enabling it to you (an image being built,
#                    a box whose systemd is not running yet)
#   --no-deps        do not install the agent's dependencies: they are importable already (e.g. a venv
#                    of your own PyTorch build); otherwise pip installs them, each checked against
#                    the sha256 in the control plane's hash-locked list
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
LOCK="@AGENT_LOCK@"            # the agent's dependencies, each with its sha256 (pip --require-hashes)
LOCK_SHA256="@AGENT_LOCK_SHA256@"
TOKEN="${ODMOE_JOIN_TOKEN:-}"
NAME="$(hostname)"
DIR=""
AGENT_USER="odmoe-agent"
SERVICE="auto"
UNIT_DIR_GIVEN=""
DEPS="yes"
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
        --user) [ $# -ge 2 ] || die "--user needs a value"; AGENT_USER="$2"; shift 2 ;;
        --no-service) SERVICE="no"; shift ;;
        --unit-dir) [ $# -ge 2 ] || die "--unit-dir needs a value"; UNIT_DIR_GIVEN="$2"; shift 2 ;;
        --no-deps) DEPS="no"; shift ;;
        --insecure) INSECURE="--insecure"; shift ;;
        --dry-run) DRY_RUN="yes"; shift ;;
        --uninstall) ACTION="uninstall"; shift ;;
        --purge) PURGE="yes"; shift ;;
        -h|--help) sed -n '2,29p' "$0" 2>/dev/null || true; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
[ "$PURGE" = "no" ] || [ "$ACTION" = "uninstall" ] || die "--purge goes with --uninstall"
[ "$SERVICE" = "auto" ] || [ -z "$UNIT_DIR_GIVEN" ] || die "--unit-dir and --no-service exclude each other"

# Root installs for a system user of the agent's own; anyone else installs for themselves.
ROOT="no"
[ "$(id -u)" = "0" ] && ROOT="yes"
if [ -z "$DIR" ]; then
    if [ "$ROOT" = "yes" ]; then DIR=/var/lib/odmoe-agent; else DIR="${HOME}/.local/share/odmoe-agent"; fi
fi
case "$DIR" in /*) ;; *) DIR="$(pwd)/$DIR" ;; esac
case "$UNIT_DIR_GIVEN" in /*|"") ;; *) UNIT_DIR_GIVEN="$(pwd)/$UNIT_DIR_GIVEN" ;; esac
# From here on, nothing of the directory this was started in: Python puts the current directory
# first on its import path for -c, -m and a script on stdin, so run as root from /tmp, a module
# another user left there (/tmp/hashlib.py, /tmp/pip/__main__.py) would run as root.
cd /

# Where a systemd unit goes for this user, and how to drive it (nothing when there is no systemd).
UNIT_DIR=""; CTL=""; WANTED=""
if [ "$ROOT" = "yes" ]; then WANTED=multi-user.target; else WANTED=default.target; fi
if [ -n "$UNIT_DIR_GIVEN" ]; then
    UNIT_DIR="$UNIT_DIR_GIVEN"  # written only: enabling it is left to the caller
elif [ "$SERVICE" = "auto" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    if [ "$ROOT" = "yes" ]; then
        UNIT_DIR=/etc/systemd/system; CTL="systemctl"
    else
        UNIT_DIR="$HOME/.config/systemd/user"; CTL="systemctl --user"
    fi
fi
UNIT="odmoe-agent.service"

if [ "$ACTION" = "uninstall" ]; then
    if [ -n "$UNIT_DIR" ] && [ -f "$UNIT_DIR/$UNIT" ]; then
        say "stopping and removing the systemd unit $UNIT"
        if [ -n "$CTL" ]; then
            # shellcheck disable=SC2086  # CTL is a command and its options
            run $CTL disable --now "$UNIT" || say "the unit would not stop cleanly; removing it anyway"
        fi
        run rm -f "$UNIT_DIR/$UNIT"
        # shellcheck disable=SC2086
        [ -z "$CTL" ] || run $CTL daemon-reload
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
    [ "$ROOT" = "no" ] || say "the system user $AGENT_USER stays (userdel $AGENT_USER removes it)"
    exit 0
fi

case "$SERVER" in http://*|https://*) ;; *) die "--server must be an http(s) URL, got '$SERVER'" ;; esac
SERVER="${SERVER%/}"
LEGACY="${HOME}/.local/share/odmoe-agent"
MOVED="no"
if [ "$ROOT" = "yes" ] && [ "$DIR" = /var/lib/odmoe-agent ] && [ ! -e "$DIR/state" ] && [ -f "$LEGACY/state/node.json" ]; then
    # Installed as root before the agent had a user of its own: its credential moves to the new place.
    say "moving the agent's state from $LEGACY/state to $DIR/state (the agent now runs as $AGENT_USER)"
    run mkdir -p "$DIR"
    run mv "$LEGACY/state" "$DIR/state"
    MOVED="yes"
fi
UPGRADE="no"
{ [ -f "$DIR/state/node.json" ] || [ "$MOVED" = "yes" ]; } && UPGRADE="yes"  # (a dry run moved nothing)
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

# As root: the agent's own system user owns its state (credential, shards, caches) and nothing
# else; the venv stays root's, so the agent cannot change the code that root runs on an upgrade.
AS_AGENT=""
STATE="$DIR/state"
if [ "$ROOT" = "yes" ]; then
    # Two installs on one box at once (two agents side by side) share the user and the account
    # files: one at a time makes them, and a user the other made meanwhile is taken as it is.
    if [ "$DRY_RUN" = "no" ] && [ -d /run/lock ] && command -v flock >/dev/null 2>&1; then
        exec 9>/run/lock/odmoe-install.lock && flock -w 120 9 || die "another install holds /run/lock/odmoe-install.lock"
    fi
    if id "$AGENT_USER" >/dev/null 2>&1; then
        say "the agent runs as the existing user $AGENT_USER"
    else
        say "creating the system user $AGENT_USER (no login, no home of its own)"
        run useradd --system --user-group --home-dir "$STATE" --no-create-home \
            --shell /usr/sbin/nologin --comment "odmoe agent" "$AGENT_USER" || \
            id "$AGENT_USER" >/dev/null 2>&1 || die "useradd $AGENT_USER failed"
    fi
    for group in video render; do  # the GPU's device files (/dev/dri, /dev/kfd); NVIDIA's are open to all
        if getent group "$group" >/dev/null 2>&1; then
            run usermod -a -G "$group" "$AGENT_USER" || die "usermod -a -G $group $AGENT_USER failed"
        fi
    done
    [ "$DRY_RUN" = "yes" ] || exec 9>&-
    run mkdir -p "$STATE"
    run chown "$AGENT_USER:" "$STATE"
    if [ "$MOVED" = "yes" ]; then
        # Root's files until now (the credential, shards, the server's certificate), the agent's
        # from now on. Only here: root never chowns the agent's own state recursively (a link the
        # agent made there could point anywhere).
        run chown -R "$AGENT_USER:" "$STATE"
    fi
    run chmod 0700 "$STATE"
    # The agent's own identity for what it runs here; HOME is its state (pip's, torch's caches).
    AS_AGENT="env HOME=$STATE setpriv --reuid=$AGENT_USER --regid=$AGENT_USER --init-groups --"
fi

if [ -x "$DIR/venv/bin/python" ]; then
    say "reusing the virtual environment $DIR/venv"
else
    say "creating a virtual environment in $DIR/venv"
    run mkdir -p "$DIR"
    run "$PYTHON" -m venv "$DIR/venv" || die "cannot create a venv in $DIR/venv (Debian/Ubuntu: apt install python3-venv)"
fi
VPY="$DIR/venv/bin/python"

# Download the server's agent/$1 to $2 as curl did the script, and keep it only if its sha256 is $3.
fetch_checked() {
    rm -f "$2.part"
    fetch "$SERVER/agent/$1" "$2.part" || { echo "odmoe install: $1 did not download from $SERVER (curl's reason is above)" >&2; return 1; }
    "$VPY" - "$2.part" "$3" <<'PY' || { rm -f "$2.part"; return 1; }
import hashlib, sys
path, want = sys.argv[1:]
got = hashlib.sha256(open(path, "rb").read()).hexdigest()
if got != want:
    sys.exit(f"odmoe install: the download has sha256 {got}, expected {want}")
PY
    mv "$2.part" "$2"
}

PACKAGE="$DIR/$WHEEL"
say "downloading the agent package $WHEEL from $SERVER (sha256 $AGENT_SHA256${PIN:+, key $PIN})"
if [ "$DRY_RUN" = "no" ]; then
    fetch_checked "$WHEEL" "$PACKAGE" "$AGENT_SHA256" || \
        die "the agent package did not download or does not match the sha256 this script was served with"
fi
if [ "$DEPS" = "yes" ]; then
    say "downloading the list of the agent's dependencies $LOCK (sha256 $LOCK_SHA256)"
    if [ "$DRY_RUN" = "no" ]; then
        fetch_checked "$LOCK" "$DIR/$LOCK" "$LOCK_SHA256" || \
            die "the dependency list did not download or does not match the sha256 this script was served with"
    fi
    say "installing the agent's dependencies, each checked against its sha256 (the first time takes a few minutes)"
    # shellcheck disable=SC2086  # ODMOE_PIP_ARGS is a list of arguments
    run "$VPY" -m pip install --quiet --disable-pip-version-check --require-hashes --only-binary :all: \
        ${ODMOE_PIP_ARGS:-} -r "$DIR/$LOCK" || \
        die "pip could not install the agent's dependencies (its messages are above; ODMOE_PIP_ARGS passes pip options, e.g. --index-url)"
else
    say "--no-deps: the agent's dependencies are taken as installed"
fi
# The same version may hold other code: put this package's files in place whatever pip thinks is there.
run "$VPY" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$PACKAGE" || \
    die "pip could not put the agent's own files in place (its messages are above)"

say "checking this box (python -m agent doctor)"
# shellcheck disable=SC2086  # AS_AGENT, PIN_ARGS and INSECURE are a command, options or nothing
run $AS_AGENT "$VPY" -m agent doctor --server "$SERVER" --state-dir "$STATE" $PIN_ARGS $INSECURE || \
    say "the doctor found problems (above): the box enrolls, but is given no role until they are fixed"

if [ "$UPGRADE" = "yes" ]; then
    say "checking the stored node credential with $SERVER"
    # With a pin (this script's, which curl checked), a box whose server changed its key follows it.
    # shellcheck disable=SC2086
    run $AS_AGENT "$VPY" -m agent --server "$SERVER" --state-dir "$STATE" --enroll-only $PIN_ARGS $INSECURE || \
        die "the stored credential in $STATE is not accepted by $SERVER (revoked? --uninstall --purge, then install with a new token)"
else
    say "enrolling $NAME"
    ODMOE_JOIN_TOKEN="$TOKEN"; export ODMOE_JOIN_TOKEN  # the agent reads it there: not on a command line
    # shellcheck disable=SC2086
    run $AS_AGENT "$VPY" -m agent --server "$SERVER" --name "$NAME" --state-dir "$STATE" --enroll-only $PIN_ARGS $INSECURE || \
        die "enrollment failed (the reason is above)"
fi

RUN="$VPY -m agent --server $SERVER --state-dir $STATE${INSECURE:+ $INSECURE}"
if [ -n "$UNIT_DIR" ]; then
    say "installing the systemd unit $UNIT_DIR/$UNIT"
    if [ "$DRY_RUN" = "no" ]; then
        mkdir -p "$UNIT_DIR"
        {
            cat <<UNIT
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
UNIT
            if [ "$ROOT" = "yes" ]; then
                # The home directories stay hidden unless the agent's own state lies under one.
                case "$STATE" in /home/*|/root/*|/run/user/*) HOMES=read-only ;; *) HOMES=yes ;; esac
                cat <<UNIT
# The agent and every runtime role it starts run as $AGENT_USER, who may write its state only.
User=$AGENT_USER
Group=$AGENT_USER
Environment=HOME=$STATE
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=$HOMES
PrivateTmp=yes
ReadWritePaths=$STATE
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
RestrictRealtime=yes
RestrictNamespaces=yes
LockPersonality=yes
CapabilityBoundingSet=
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
UMask=0077
LimitNOFILE=65536
UNIT
                if command -v nvidia-modprobe >/dev/null 2>&1; then
                    # The CUDA driver creates /dev/nvidia-uvm through the setuid nvidia-modprobe, which
                    # NoNewPrivileges stops: done here first, with full privileges ("+"), failure ignored ("-").
                    echo "ExecStartPre=-+$(command -v nvidia-modprobe) -u -c0"
                fi
            fi
            cat <<UNIT

[Install]
WantedBy=$WANTED
UNIT
        } > "$UNIT_DIR/$UNIT"
    fi
    if [ -n "$CTL" ]; then
        # shellcheck disable=SC2086  # CTL is a command and its options
        run $CTL daemon-reload
        # shellcheck disable=SC2086
        run $CTL enable "$UNIT"
        # shellcheck disable=SC2086
        run $CTL restart "$UNIT"  # an upgrade starts the new code
        say "done; the agent runs as the systemd unit odmoe-agent ($CTL status odmoe-agent)"
    else
        say "done; the unit is written, not enabled: systemctl enable --now $UNIT once it is in place"
    fi
else
    say "done; start the agent with:"
    if [ -n "$AS_AGENT" ]; then echo "    $AS_AGENT $RUN"; else echo "    $RUN"; fi
fi
