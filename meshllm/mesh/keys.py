"""Per-node CURVE identities and admission: key files, the authorized-keys list, the ZAP check.

Every node has its own CURVE key pair. Its secret key lives in a key file (`node_key:` in the
node file; `python launch.py --keygen FILE` writes one, mode 0600, and prints the public key).
The mesh's membership list is an authorized-keys file (`authorized_keys:`), one line per node:

    # node id   z85 public key (40 characters); '#' starts a comment line only
    fog-1       rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7
    admin       Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID

Servers (ROUTER, PUB) use the node's own secret key and run ZeroMQ's ZAP through pyzmq's
`zmq.auth` authenticator (one per zmq.Context, one ZAP domain per node): a client whose
public key is not listed is refused during the handshake, so it can send nothing and read
nothing (not even PUB topics). An admitted client's messages carry the ZAP User-Id (its z85
public key), which `NodeKeys.who` maps back to its node id; the transport drops a message
whose `src` (or `node` field) names anyone else. Clients (DEALER, SUB) pin the server's
public key: the node id at that address (`pin`, from seeds `ID@HOST:PORT`, gossip, mDNS)
is looked up in the authorized keys, so a reply or a publication on that connection can only
come from that node.

A simpler mode shares one key pair among all nodes (`cluster_key:` in the node file, a key file
made with `--keygen` and copied to every node; `NodeKeys.cluster`): every socket is still CURVE,
encrypted, and a client without that key is refused during the handshake, but the key names no
node, so a holder of it may speak as any node id (`ANY_NODE`: its messages say who sent them).
Per-node keys are the stronger mode; a cluster key keeps outsiders out, nothing more.

A running node re-reads its authorized-keys file when it changes (`NodeKeys.refresh`, every
AUTH_RELOAD_S on the node's I/O thread): a node added to the file can join without restarting
anyone; a node removed (or re-keyed) loses its pins and connections, its messages are dropped
from then on, and membership declares it dead. A file that no longer parses, or that drops this
node's own key, is logged and ignored: the list in force stays.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.utils import z85

from meshllm.errors import ConfigError, InputError
from meshllm.yaml_fields import NODE_ID, read_text_file

log = logging.getLogger("meshllm.mesh.keys")

KEY_FILE_HEADER = "# meshllm CURVE secret key (z85). Keep it private: whoever holds it is this node."
Z85_KEY_CHARS = 40  # a 32-byte CURVE key in z85
AUTH_RELOAD_S = 2.0  # a node checks its authorized-keys file for changes this often
_domains = itertools.count(1)
ANY_NODE = "*"  # who a cluster key's holder is (no node id has a '*': yaml_fields.node_id)


class UnknownPeerKey(TimeoutError):
    """No public key is pinned for this address yet (its node id is not known, or not in the
    authorized keys): the peer cannot be reached securely, as if it did not answer."""


def _z85_key(text: str) -> bytes | None:
    """A z85 CURVE key (bytes) if `text` is one, else None."""
    if len(text) != Z85_KEY_CHARS:
        return None
    try:
        raw = z85.decode(text.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        return None
    return text.encode("ascii") if len(raw) == 32 else None


def generate_key(path: str | Path) -> str:
    """Write a new secret key to `path` (mode 0600; an existing file is never overwritten) and
    return its z85 public key. InputError if the file exists or cannot be written."""
    public, secret = zmq.curve_keypair()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InputError(f"{path}: already exists; a key file is never overwritten") from None
    except OSError as e:
        raise InputError(f"{path}: cannot create the key file: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(f"{KEY_FILE_HEADER}\n{secret.decode()}\n")
    return public.decode()


def read_secret_key(path: str, src: str, fld: str) -> bytes:
    """The z85 secret key in a key file written by `generate_key`; ConfigError otherwise."""
    lines = read_text_file(path, src, fld, "a secret key file", secret=True).splitlines()
    keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    key = _z85_key(keys[0]) if len(keys) == 1 else None
    if key is None:
        raise ConfigError(src, fld, f"{path!r} is not a meshllm key file (one z85 secret key of {Z85_KEY_CHARS} "
                                    "characters; make one with `python launch.py --keygen FILE`)")
    return key


def read_authorized_keys(path: str, src: str, fld: str) -> dict[str, bytes]:
    """node id -> z85 public key from an authorized-keys file; ConfigError on any bad line."""
    text = read_text_file(path, src, fld, "an authorized-keys file")
    out: dict[str, bytes] = {}
    owner: dict[bytes, str] = {}
    for i, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts or parts[0].startswith("#"):  # whole-line comments only: '#' is a z85 character
            continue
        key = _z85_key(parts[1]) if len(parts) == 2 else None
        if key is None:
            raise ConfigError(src, fld, f"{path}, line {i}: expected `NODE_ID Z85_PUBLIC_KEY`, got {line.strip()!r:.80}")
        if not NODE_ID.fullmatch(parts[0]):  # a '*' here was taken for a cluster key: its holder posed as any node
            raise ConfigError(src, fld, f"{path}, line {i}: {parts[0]!r:.80} is not a node id (1 to 63 letters, "
                                        "digits, '_', '-' or '.', from a letter or digit)")
        if parts[0] in out:
            raise ConfigError(src, fld, f"{path}, line {i}: node id {parts[0]!r} is listed twice")
        if key in owner:
            raise ConfigError(src, fld, f"{path}, line {i}: the key of {parts[0]!r} is already {owner[key]!r}'s")
        out[parts[0]], owner[key] = key, parts[0]
    if not out:
        raise ConfigError(src, fld, f"{path}: lists no keys")
    return out


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


def handshake_failure(event: int, peer: str | None, address: str, keys: NodeKeys) -> str:
    """What a client's failed CURVE handshake with the node at `address` (pinned to `peer`) says:
    the node refused this identity's key (ZAP), or the node there did not prove it holds the key
    pinned for it (another node listens there, or it runs without CURVE or with another key)."""
    if keys.shared:
        return (f"the CURVE handshake with the node at {address} failed: it "
                + ("refused this cluster key" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else
                   "does not hold this cluster key (another mesh's key, or it runs without CURVE)"))
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the node at {address} refused the key of {keys.node_id!r} (is `{keys.node_id} "
                f"{keys.public.decode()}` in its authorized keys?)")
    return (f"the CURVE handshake with the node at {address} failed: it does not hold the key of {peer!r} "
            "(another node listens there, or it runs without CURVE or with another key)")


class NodeKeys:
    """One node's CURVE identity, the mesh's authorized keys, and the address -> node id pins of
    its client connections. Thread-safe."""

    def __init__(self, node_id: str, secret: bytes, authorized: dict[str, bytes], shared: bool = False):
        self.node_id, self.secret, self.shared = node_id, secret, shared
        self.public = zmq.curve_public(secret)
        if not shared and authorized.get(node_id) != self.public:
            raise ValueError(f"the authorized keys list no key for {node_id!r} matching its key file")
        self.authorized = dict(authorized)
        self._ids = {k: nid for nid, k in authorized.items()}
        self._pins: dict[str, tuple[str, bool]] = {}  # address -> (node id, first-hand)
        self._lock = threading.Lock()
        self.path: str | None = None  # the authorized-keys file `refresh` re-reads
        self._seen: tuple | None = None  # its (mtime, size, inode) when last read

    @staticmethod
    def load(node_id: str, key_file: str, authorized_keys: str, src: str = "node file") -> NodeKeys:
        secret = read_secret_key(key_file, src, "node_key")
        authorized = read_authorized_keys(authorized_keys, src, "authorized_keys")
        try:
            keys = NodeKeys(node_id, secret, authorized)
        except ValueError as e:
            raise ConfigError(src, "authorized_keys", f"{authorized_keys}: {e}") from None
        keys.path, keys._seen = authorized_keys, _file_stamp(authorized_keys)
        return keys

    @staticmethod
    def cluster(node_id: str, key_file: str, src: str = "node file") -> NodeKeys:
        """One key pair that every node of the mesh holds (`cluster_key:`): any holder is admitted."""
        return NodeKeys(node_id, read_secret_key(key_file, src, "cluster_key"), {}, shared=True)

    @staticmethod
    def from_env(node_id: str = "") -> NodeKeys | None:
        """The CLI's identity: $MESHLLM_CLUSTER_KEY, or $MESHLLM_NODE_KEY and $MESHLLM_AUTHORIZED_KEYS
        (None if unset). With per-node keys its id is the authorized-keys line whose key matches
        the key file (`node_id` is only a hint)."""
        key, auth = os.environ.get("MESHLLM_NODE_KEY"), os.environ.get("MESHLLM_AUTHORIZED_KEYS")
        shared = os.environ.get("MESHLLM_CLUSTER_KEY")
        if shared and (key or auth):
            raise InputError("give $MESHLLM_CLUSTER_KEY, or $MESHLLM_NODE_KEY with $MESHLLM_AUTHORIZED_KEYS; not both")
        if shared:
            return NodeKeys.cluster(node_id, shared, "$MESHLLM_CLUSTER_KEY")
        if not key and not auth:
            return None
        if not key or not auth:
            raise InputError("a mesh with CURVE needs both MESHLLM_NODE_KEY and MESHLLM_AUTHORIZED_KEYS")
        secret = read_secret_key(key, "$MESHLLM_NODE_KEY", key)
        authorized = read_authorized_keys(auth, "$MESHLLM_AUTHORIZED_KEYS", auth)
        public = zmq.curve_public(secret)
        mine = [nid for nid, k in authorized.items() if k == public]
        if not mine:
            raise InputError(f"{auth}: lists no key matching {key} (add `ID {public.decode()}`)")
        return NodeKeys(node_id if node_id in mine else mine[0], secret, authorized)

    # -- the authorized keys, live ----------------------------------------------------------
    def reload(self, authorized: dict[str, bytes]) -> tuple[set[str], set[str], list[str]]:
        """Put a new authorized-keys list in force: (ids added or re-keyed, ids removed or re-keyed,
        addresses whose pin named one of the latter: their pins are dropped, so no connection to
        them is made or kept). ValueError if the list lacks this node's own key."""
        if self.shared or authorized.get(self.node_id) != self.public:
            raise ValueError(f"the authorized keys list no key for {self.node_id!r} matching its key file")
        old = self.authorized
        gone = {nid for nid, k in old.items() if authorized.get(nid) != k}
        added = {nid for nid, k in authorized.items() if old.get(nid) != k}
        with self._lock:
            self.authorized, self._ids = dict(authorized), {k: nid for nid, k in authorized.items()}
            dropped = [a for a, (nid, _) in self._pins.items() if nid in gone]
            for a in dropped:
                del self._pins[a]
        return added, gone, dropped

    def refresh(self) -> tuple[set[str], set[str], list[str]] | None:
        """Re-read the authorized-keys file if it changed since it was last read, and `reload` it;
        None if it did not change, or if the new file is bad (logged; the list in force stays)."""
        if self.path is None:
            return None
        stamp = _file_stamp(self.path)
        if stamp == self._seen:
            return None
        self._seen = stamp
        try:
            changes = self.reload(read_authorized_keys(self.path, self.node_id, "authorized_keys"))
        except (ConfigError, ValueError) as e:
            log.error("%s: authorized keys not reloaded, the previous list stays in force: %s", self.node_id, e)
            return None
        added, gone, _ = changes
        log.info("%s: authorized keys reloaded from %s: %d listed%s%s", self.node_id, self.path,
                 len(self.authorized), f", added {sorted(added)}" if added else "",
                 f", removed {sorted(gone)}" if gone else "")
        return changes

    # -- identities ------------------------------------------------------------------------
    def who(self, z85_public: str | bytes | None) -> str | None:
        """The node id of an authorized z85 public key (a ZAP User-Id), ANY_NODE for the cluster
        key, else None."""
        if z85_public is None:
            return None
        key = z85_public.encode() if isinstance(z85_public, str) else z85_public
        if self.shared:
            return ANY_NODE if key == self.public else None
        return self._ids.get(key)

    def admits(self, node_id: str) -> bool:
        return self.shared or node_id in self.authorized

    def pin(self, node_id: str, address: str, first_hand: bool) -> bool:
        """Say that the node at `address` is `node_id`: its connections will demand that node's key.
        First-hand news (a seed in the node file, a HELLO or a PEERS entry about its authenticated
        sender itself) replaces any pin; second-hand news (other gossip entries, mDNS) only fills a
        gap. False if `node_id` is not admitted or second-hand news names another node than the pin."""
        if not self.admits(node_id):
            return False
        with self._lock:
            old = self._pins.get(address)
            if old is None:
                self._pins[address] = (node_id, first_hand)
            elif old[0] == node_id:
                self._pins[address] = (node_id, first_hand or old[1])
            elif first_hand:
                self._pins[address] = (node_id, True)
            else:
                return False
            return True

    def peer_at(self, address: str) -> str:
        with self._lock:
            pinned = self._pins.get(address)
        if pinned is None:
            if self.shared:  # every node's key is the cluster key: who it is, its messages say
                return ANY_NODE
            raise UnknownPeerKey(f"no public key known for the node at {address} (its node id is not known yet; "
                                 "a seed must be given as ID@HOST:PORT)")
        return pinned[0]

    # -- sockets ---------------------------------------------------------------------------
    def server(self, sock: zmq.Socket, domain: str) -> None:
        """A ROUTER or PUB of this node: CURVE server with its own key, clients checked by ZAP."""
        sock.curve_secretkey, sock.curve_publickey = self.secret, self.public
        sock.curve_server = True
        sock.zap_domain = domain.encode()

    def client(self, sock: zmq.Socket, address: str) -> str:
        """A DEALER or SUB to `address`: this node's key pair, the pinned peer's public key.
        Returns that peer's node id. Raises UnknownPeerKey."""
        peer = self.peer_at(address)
        sock.curve_secretkey, sock.curve_publickey = self.secret, self.public
        sock.curve_serverkey = self.public if self.shared else self.authorized[peer]
        return peer


def _file_stamp(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class _Provider:
    """zmq.auth's CURVE credentials callback for one node's ZAP domain."""

    def __init__(self, keys: NodeKeys, refused: Callable[[bytes], None]):
        self.keys, self.refused = keys, refused

    def callback(self, domain: str, z85_key: bytes) -> bool:
        if self.keys.who(z85_key) is not None:
            return True
        self.refused(z85_key)
        return False


class Admission:
    """ZAP for one node: registers its domain with its context's authenticator (pyzmq's
    ThreadAuthenticator, started on first use and kept for the context's life: the inproc ZAP
    endpoint is released asynchronously, so a stop and restart could not rebind it). Create it
    before binding any CURVE server socket, so no handshake ever runs without the check."""

    _lock = threading.Lock()
    _auth: dict[int, object] = {}  # id(context) -> its ThreadAuthenticator

    def __init__(self, ctx: zmq.Context, keys: NodeKeys, refused: Callable[[bytes], None]):
        from zmq.auth.thread import ThreadAuthenticator

        self.ctx, self.domain = ctx, f"meshllm-{os.getpid()}-{next(_domains)}"
        with Admission._lock:
            auth = Admission._auth.get(id(ctx))
            if auth is None:
                auth = ThreadAuthenticator(ctx, log=logging.getLogger("meshllm.mesh.zap"))
                auth.start()  # the ZAP socket is bound when this returns
                Admission._auth[id(ctx)] = auth
            auth.configure_curve_callback(self.domain, _Provider(keys, refused))
        self._auth = auth

    def close(self) -> None:
        """Forget this node's domain: a handshake on it is refused from now on."""
        self._auth.credentials_providers.pop(self.domain, None)
