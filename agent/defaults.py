"""What the agent's commands share (``python -m agent`` and ``python -m agent doctor``): where the
agent keeps its state by default, and the exit codes the systemd unit reads."""

from __future__ import annotations

from pathlib import Path

DEFAULT_STATE_DIR = Path.home() / ".local" / "state" / "odmoe-agent"
# The control plane refused this agent for good (credential revoked, link protocol too old): the
# systemd unit does not restart on it (RestartPreventExitStatus in install.sh).
EXIT_REFUSED = 3
EXIT_USAGE = 2  # refused arguments (argparse's code too): a restart cannot help either
