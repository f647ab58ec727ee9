"""Moving tensors between instances: cache snapshots from prefill instances to decode
instances, and image embeddings from encode instances to the instances that run the prompts.

A receiving instance runs a `KVReceiver` on a port; senders reach it through a `KVSender`.
Every connection starts with a handshake: the sender states what it sends (model fingerprint
and the layout of its tables) and the receiver refuses a connection whose layout differs from
its own, naming the first difference (other stacks find such a mismatch only as garbage
output). Then each transfer is a parcel: a header (JSON: id, the caller's metadata, tensor
names, dtypes and shapes, optionally a checksum) and the tensors' bytes, which travel one of
two ways:

    tcp    over the same socket, in chunks of CHUNK_BYTES
    gloo   through a two-rank torch.distributed gloo group made for the connection (the
           socket then carries only headers and acknowledgements)

A transfer is acknowledged once the receiver holds it whole (checked against its header and,
in debug mode, its checksum); a snapshot nobody claims is dropped after `ttl_s`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
CONNECT_TIMEOUT_S = 10.0
TRANSPORTS = ("tcp", "gloo")
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64,
                               torch.float8_e4m3fn)}  # fmt: skip


class KVTransferError(RuntimeError):
    pass


# ---- framing ---------------------------------------------------------------------------------
def _send_json(sock: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, CHUNK_BYTES))
        if k == 0:
            raise KVTransferError("the peer closed the connection mid-transfer")
        got += k
    return buf


def _recv_json(sock: socket.socket):
    (n,) = struct.unpack("!Q", _recv_exact(sock, 8))
    return json.loads(bytes(_recv_exact(sock, n)))


def model_fingerprint(model_path, dtype: str) -> str:
    """The model both ends of a link must run: its config and dtype."""
    config = (model_path / "config.json").read_bytes()
    return hashlib.blake2b(config + dtype.encode(), digest_size=16).hexdigest()


def embedding_description(model_path, dtype: str, out_hidden_size: int) -> dict:
    """What an encode instance sends and an --mm-port receiver takes: embeddings of this model."""
    return {"model": model_fingerprint(model_path, dtype), "layout": [["mm_embeddings", dtype, [out_hidden_size], 0]]}


def layout_difference(mine: dict, theirs: dict) -> str | None:
    """The first difference between two instances' descriptions (None: compatible)."""
    if mine["model"] != theirs["model"]:
        return f"different models or dtypes ({theirs['model'][:12]} vs {mine['model'][:12]})"
    a, b = mine["layout"], theirs["layout"]
    for x, y in zip(b, a):
        if x != y:
            return f"cache layout differs: sender {x} vs receiver {y}"
    if len(a) != len(b):
        return f"cache layout differs: sender has {len(b)} tables, receiver {len(a)}"
    return None


@dataclass
class Parcel:
    meta: dict  # JSON-able
    tensors: dict[str, torch.Tensor]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def checksum(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(self.tensors):
            h.update(name.encode())
            h.update(self.tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def _header(transfer_id: str, parcel: Parcel, debug: bool) -> dict:
    return {"transfer_id": transfer_id, "meta": parcel.meta,
            "tensors": [[name, str(t.dtype), list(t.shape)] for name, t in parcel.tensors.items()],
            "checksum": parcel.checksum() if debug else None}  # fmt: skip


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's storage as a flat uint8 array (shared, not copied)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _empty(dtype: str, shape: list[int]) -> torch.Tensor:
    if dtype not in _DTYPES:
        raise KVTransferError(f"tensor dtype {dtype} is not transferable")
    return torch.empty(shape, dtype=_DTYPES[dtype])


# ---- sending ---------------------------------------------------------------------------------
class KVSender:
    """A prefill instance's side: one connection per decode instance, made on first use."""

    def __init__(self, description: dict, transport: str = "tcp", debug: bool = False):
        if transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {TRANSPORTS}, got {transport!r}")
        self.description, self.transport, self.debug = description, transport, debug
        self._links: dict[str, _Link] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()  # guards the two dicts

    def send(self, address: str, transfer_id: str, parcel: Parcel, timeout_s: float = 60.0) -> None:
        """Deliver `parcel` to the receiver at host:port; KVTransferError if it does not land."""
        with self._lock:
            lock = self._locks.setdefault(address, threading.Lock())
        with lock:  # one transfer at a time per link (a slow receiver holds up only its own)
            link = self._links.get(address)
            try:
                if link is None:
                    link = self._links[address] = _Link.open(address, self.description, self.transport)
                link.send(transfer_id, parcel, self.debug, timeout_s)
            except (OSError, KVTransferError) as e:
                self._links.pop(address, None)
                if link is not None:
                    link.close()
                raise KVTransferError(f"sending the caches to {address} failed: {e}") from None

    def close(self) -> None:
        with self._lock:
            for link in list(self._links.values()):
                link.close()
            self._links.clear()


class _Link:
    def __init__(self, sock: socket.socket, group):
        self.sock, self.group = sock, group

    @classmethod
    def open(cls, address: str, description: dict, transport: str) -> _Link:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send_json(sock, {**description, "transport": transport})
        reply = _recv_json(sock)
        if not reply.get("ok"):
            sock.close()
            raise KVTransferError(f"the decode instance refused the connection: {reply.get('error')}")
        group = _pair_group(host, reply["store_port"], rank=0) if transport == "gloo" else None
        return cls(sock, group)

    def send(self, transfer_id: str, parcel: Parcel, debug: bool, timeout_s: float) -> None:
        self.sock.settimeout(timeout_s)
        _send_json(self.sock, _header(transfer_id, parcel, debug))
        for t in parcel.tensors.values():
            t = t.contiguous().cpu()
            if self.group is not None:
                self.group.send([t], 1, 0).wait()
            else:
                self.sock.sendall(_bytes_of(t))
        reply = _recv_json(self.sock)
        if not reply.get("ok"):
            raise KVTransferError(reply.get("error", "the receiver refused the transfer"))

    def close(self) -> None:
        self.sock.close()


def _pair_group(host: str, port: int, rank: int):
    """A two-rank gloo group (0: sender, 1: receiver) through a TCPStore the receiver hosts."""
    store = dist.TCPStore(host, port, 2, is_master=rank == 1, timeout=timedelta(seconds=CONNECT_TIMEOUT_S))
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))


# ---- receiving -------------------------------------------------------------------------------
class KVReceiver:
    """A decode instance's side: accepts senders on `port` and keeps what they deliver until
    `take(transfer_id)` claims it."""

    def __init__(self, description: dict, host: str = "0.0.0.0", port: int = 0, ttl_s: float = 120.0,
                 max_bytes: int = 8 << 30):  # fmt: skip
        self.description, self.ttl_s, self.max_bytes = description, ttl_s, max_bytes
        self._inbox: OrderedDict[str, tuple[float, Parcel]] = OrderedDict()
        self._held = 0
        self._cond = threading.Condition()
        self._server = socket.create_server((host, port), reuse_port=False)
        self.port = self._server.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="oxserve-kv-accept", daemon=True).start()

    def take(self, transfer_id: str, timeout_s: float = 10.0) -> Parcel:
        """The parcel sent under `transfer_id` (waiting up to `timeout_s` for it)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while transfer_id not in self._inbox:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTransferError(f"nothing arrived for transfer {transfer_id} within {timeout_s:g} s")
                self._cond.wait(left)
            _, parcel = self._inbox.pop(transfer_id)
            self._held -= parcel.nbytes()
            return parcel

    def close(self) -> None:
        self._closed = True
        self._server.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="oxserve-kv-link", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            hello = _recv_json(sock)
            if (why := layout_difference(self.description, hello)) is not None:
                log.error("oxserve: refused a KV sender: %s", why)
                _send_json(sock, {"ok": False, "error": why})
                return
            group, store_port = None, None
            if hello.get("transport") == "gloo":
                store_port = _free_port()
                _send_json(sock, {"ok": True, "store_port": store_port})
                group = _pair_group(sock.getsockname()[0], store_port, rank=1)
            else:
                _send_json(sock, {"ok": True})
            while True:
                header = _recv_json(sock)
                tensors = {}
                for name, dtype, shape in header["tensors"]:
                    t = _empty(dtype, shape)
                    if group is not None:
                        group.recv([t], 0, 0).wait()
                    else:
                        _bytes_of(t)[:] = np.frombuffer(_recv_exact(sock, t.numel() * t.element_size()), np.uint8)
                    tensors[name] = t
                parcel = Parcel(header["meta"], tensors)
                if header["checksum"] is not None and parcel.checksum() != header["checksum"]:
                    _send_json(sock, {"ok": False, "error": "checksum mismatch: the tensors were damaged in transit"})
                    continue
                self._keep(header["transfer_id"], parcel)
                _send_json(sock, {"ok": True})
        except (OSError, KVTransferError, ValueError, json.JSONDecodeError, struct.error):
            pass  # the sender went away; what it sent whole is kept
        finally:
            sock.close()

    def _keep(self, transfer_id: str, parcel: Parcel) -> None:
        with self._cond:
            now = time.monotonic()
            while self._inbox and (now - next(iter(self._inbox.values()))[0] > self.ttl_s or self._held + parcel.nbytes() > self.max_bytes):
                _, (_, old) = self._inbox.popitem(last=False)  # unclaimed: its request went elsewhere or failed
                self._held -= old.nbytes()
            self._inbox[transfer_id] = (now, parcel)
            self._held += parcel.nbytes()
            self._cond.notify_all()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
