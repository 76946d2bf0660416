"""Who may join: the trainer's allow-list of CURVE client keys, each with the roles it may take, enforced
in two places. ZeroMQ's ZAP handler (pyzmq's asyncio authenticator, in the server's own context) admits
only listed keys, so an unknown key never completes the CURVE handshake; the Server then checks the role
of each Hello against the key ZeroMQ attached to its connection (the message's "User-Id"). Private to
protocol/: Server(client_roles=...) uses it. Wire rules: protocol/SPEC.md, "Authentication (CURVE)".
Test: pytest tests/protocol/test_auth.py

Allow-list file (load_client_roles): one client per line, `<Z85 public key> <role>[,<role>...]`, then
optionally `# comment`; lines starting with `# ` are comments ('#' alone is a Z85 character). Example:
    rT9c...(40 characters)...   generator,tool   # the generator hosts
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

from tailrace.protocol._wire import log
from tailrace.protocol.messages import ROLES

PEER_ROLES = tuple(r for r in ROLES if r != "trainer")


def load_client_roles(path: str | Path) -> dict[str, frozenset[str]]:
    """Parse an allow-list file (format in the module docstring). ValueError names the line at fault."""
    roles: dict[str, frozenset[str]] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split(None, 2)  # Z85 has '#' among its characters: a comment is "# " or follows the roles
        if not fields or fields[0] == "#" or line.lstrip().startswith("# "):
            continue
        if len(fields) < 2 or (len(fields) == 3 and not fields[2].startswith("#")):
            raise ValueError(f"{path}:{number}: expected '<Z85 public key> <role>[,<role>...] [# comment]'")
        roles[fields[0]] = frozenset(fields[1].split(","))
    return check_client_roles(roles, str(path))


def check_client_roles(client_roles: Mapping[str, Iterable[str]], where: str = "client_roles"
                       ) -> dict[str, frozenset[str]]:
    checked = {}
    for key, allowed in client_roles.items():
        allowed = frozenset(allowed)
        if len(key) != 40:
            raise ValueError(f"{where}: {key[:12]!r}... is not a 40-character Z85 public key")
        try:
            z85.decode(key)
        except (ValueError, KeyError):
            raise ValueError(f"{where}: {key[:12]!r}... is not valid Z85") from None
        if not allowed or not allowed <= set(PEER_ROLES):
            raise ValueError(f"{where}: roles of {key[:12]}... must be among {PEER_ROLES}, got {sorted(allowed)}")
        checked[key] = allowed
    return checked


class _Provider:
    """The authenticator's question, "may this key connect?", answered from the allow-list."""

    def __init__(self, roles: dict[str, frozenset[str]]):
        self.roles = roles
        self.refused = 0

    def callback(self, domain: str, key_z85: bytes) -> bool:
        allowed = key_z85.decode() in self.roles
        if not allowed:
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # 1, 2, 4, ...: ZeroMQ retries a refused client often
                log.warning("refused a CURVE client with an unknown key %s (%d refusals so far)",
                            key_z85.decode(), self.refused)
        return allowed


class ClientKeys:
    """The allow-list and the ZAP handler that enforces it for every CURVE socket of one context."""

    def __init__(self, client_roles: Mapping[str, Iterable[str]]):
        self.roles = check_client_roles(client_roles)
        self._provider = _Provider(self.roles)
        self._authenticator: Any = None

    @property
    def num_refused(self) -> int:
        return self._provider.refused

    def may(self, key: str, role: str) -> bool:
        return role in self.roles.get(key, ())

    async def start(self, context: zmq.Context) -> None:
        import zmq.asyncio
        from zmq.auth.asyncio import AsyncioAuthenticator

        self._authenticator = AsyncioAuthenticator(zmq.asyncio.Context.shadow(context.underlying),
                                                   log=log.getChild("zap"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback(domain="*", credentials_provider=self._provider)

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
