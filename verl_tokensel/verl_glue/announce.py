"""The one line a worker prints when it receives a selecting loss (``SelectingLoss.__setstate__``).

``verl_tokensel <version> (<package folder>): token_selector=<preset> loss installed in pid <pid> on node <ip>``,
once per process and preset, on stderr (Ray forwards it to the driver's log with the worker's prefix): on a
multi-node cluster it shows every node where selection is active, and from which installed copy.
"""

from __future__ import annotations

_ANNOUNCED: set = set()


def loss_announcement(loss) -> str:
    """The line a worker prints when it receives a selecting loss: version, package folder, selector, pid, node."""
    import os
    import socket
    import sys
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("verl-tokensel")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        ours = "unknown"
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../verl_tokensel
    node = None
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        node = ray.util.get_node_ip_address()
    name = getattr(loss.config, "token_selector", None) or "custom"
    return (f"verl_tokensel {ours} ({package}): "
            f"token_selector={name} loss installed in pid {os.getpid()} on node {node or socket.gethostname()}")


def announce_loss(loss) -> None:
    """Print :func:`loss_announcement` to stderr, once per process and selector."""
    import sys

    key = getattr(loss.config, "token_selector", None)
    if key in _ANNOUNCED:
        return
    _ANNOUNCED.add(key)
    try:
        print(loss_announcement(loss), file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - a log line must never break the install
        print(f"verl-tokensel: selecting loss installed (announcement failed: {e})", file=sys.stderr, flush=True)
