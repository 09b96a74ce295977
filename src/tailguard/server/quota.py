"""Per-client request quotas: token buckets keyed on who the client is (429 beyond them).

Who the client is must not be something it can change at will:
- behind a proxy listed in `trusted_proxies` (the peer address is the proxy's), the proxy's
  `X-Client-Id` names the client; from any other peer that header is ignored;
- otherwise the peer address, together with the API key's value when `api_key` is set (the key
  is checked before the quota; `Bearer` is matched in any case, so spelling variants of one key
  share a bucket).
An unchecked `Authorization` header is never part of the identity: without `api_key` a client
could send a new token per request and get a fresh bucket each time.

At most `max_clients` buckets are kept; past that the least recently seen client is forgotten.
Forgetting costs little: a client idle for `burst / rps` seconds has a full bucket anyway, and a
client flooding new identities cannot clear anyone else's state (before: all buckets were
cleared at once past 100,000 identities).
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections import OrderedDict
from collections.abc import Mapping

__all__ = ["ClientQuota", "TrustedProxies", "bearer_token"]

_MAX_KEY = 64  # longer identities are stored as a 16-byte digest (bounded memory per bucket)


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of `Authorization: Bearer <token>` (scheme in any case), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


class TrustedProxies:
    """Peer addresses (single addresses or networks) whose forwarded client id is believed."""

    def __init__(self, entries: tuple[str, ...]) -> None:
        self._networks = [ipaddress.ip_network(e, strict=False) for e in entries]
        self._seen: dict[str, bool] = {}  # peer -> trusted (peers are few: proxies, clients)

    def __bool__(self) -> bool:
        return bool(self._networks)

    def __contains__(self, peer: str) -> bool:
        known = self._seen.get(peer)
        if known is None:
            try:
                addr = ipaddress.ip_address(peer)
            except ValueError:
                known = False
            else:
                known = any(addr in net for net in self._networks)
            if len(self._seen) >= 65_536:
                self._seen.clear()
            self._seen[peer] = known
        return known


class ClientQuota:
    """Token buckets per client identity, least recently used forgotten first."""

    def __init__(
        self, rps: float, burst: int, max_clients: int, trusted_proxies: tuple[str, ...] = ()
    ) -> None:
        self.rps, self.burst, self.max_clients = rps, burst, max_clients
        self.proxies = TrustedProxies(trusted_proxies)
        # identity -> (tokens, last time); oldest use first
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def identity(self, headers: Mapping[bytes, bytes], peer: str, api_key: bytes | None) -> bytes:
        """Who a request is from (see the module docstring); `api_key`: the checked key, or
        None when the server has none."""
        if self.proxies and peer in self.proxies:
            forwarded = headers.get(b"x-client-id")
            if forwarded:
                return self._short(b"id:" + forwarded)
        key = b"ip:" + peer.encode()
        if api_key is not None:
            key += b" key:" + api_key
        return self._short(key)

    @staticmethod
    def _short(key: bytes) -> bytes:
        if len(key) <= _MAX_KEY:
            return key
        return b"h:" + hashlib.blake2b(key, digest_size=16).digest()

    def take(self, client: bytes, now: float) -> float:
        """0 when allowed, else seconds until a token is available."""
        buckets = self._buckets
        state = buckets.get(client)
        if state is None:
            tokens = float(self.burst)
            if len(buckets) >= self.max_clients:
                buckets.popitem(last=False)  # the least recently seen client
        else:
            tokens = min(self.burst, state[0] + (now - state[1]) * self.rps)
            buckets.move_to_end(client)
        if tokens >= 1.0:
            buckets[client] = (tokens - 1.0, now)
            return 0.0
        buckets[client] = (tokens, now)
        return (1.0 - tokens) / self.rps
