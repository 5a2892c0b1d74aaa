"""The agent's configuration: one frozen value built by `p2pmesh agent` (cli/agent_cmd.py) or
by an embedder (`p2pmesh.Agent`). The runtime cuts it into each task's own config."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from p2pmesh.agent.http.config import HttpEndpoint
from p2pmesh.core.protocol import BATCH_REQUESTS_DEFAULT, QUEUE_REQUESTS_DEFAULT
from p2pmesh.core.settings import Settings

DEFAULT_PORT = 7741


def default_state_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "p2pmesh"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "p2pmesh"


@dataclass(frozen=True)
class AgentConfig:
    state_dir: Path = field(default_factory=default_state_dir)
    listen: tuple[str, ...] = (f":{DEFAULT_PORT}",)
    """Every IPv4 and IPv6 address: the agent advertises its IPv6 link-local addresses too."""
    peers: tuple[str, ...] = ()
    interfaces: tuple[str, ...] = ()
    cluster_key_file: Path | None = None
    advertise: tuple[str, ...] = ()
    """Addresses other agents should dial (defaults to the listen address)."""
    settings: Settings = Settings()
    leave_on_exit: bool = False
    mdns: bool = True
    configure_links: bool = False
    """Add the planned data-plane addresses to this Mac's ring interfaces (explicit consent)."""
    data_port_base: int = 47000
    """Workers of data-plane epoch E listen on base + (E mod 64) * 16 + rank."""
    model_root: Path | None = None
    """Where relative model names are looked up (tests and the demo; default: as given)."""
    memory_limit_bytes: int | None = None
    """Offer at most this much memory to the cluster (a Mac someone also works on)."""
    layer_ms: float | None = None
    """Publish this time per layer instead of the measured one (the memory is still measured)."""
    max_batch: int = BATCH_REQUESTS_DEFAULT
    """Requests this Mac's head worker serves at once (continuous batching)."""
    max_queue: int = QUEUE_REQUESTS_DEFAULT
    """Requests its head worker holds waiting for a slot; beyond them a request gets busy."""
    http: HttpEndpoint | None = None
    """Where to serve the OpenAI-compatible HTTP API (docs/http.md); None: not served."""
    copy_over_tls: bool = False
    """Model-file bytes travel inside TLS, both ways (confidential, slower); default: over a
    plain TCP connection tied to the TLS session, checked by SHA-256 (docs/security.md)."""

    @property
    def socket_path(self) -> Path:
        return self.state_dir / "agent.sock"
