"""Wire protocol: round-trips of every message type and tensor dtype; decode fuzzing."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshllm.mesh import protocol as p
from meshllm.mesh.fields import sampling_map
from meshllm.mesh.protocol import MsgType, ProtocolError, decode, encode, make

SPAN = p.WireSpan(11, 0, 3, p.SpanKind.PREFILL_LAST, 0, 0.7, 40, 0.9, 3)
DEVICE = {"name": "inline", "memory_gb": 8.0, "compute_tflops": 1.0, "memory_bandwidth_gbps": 50.0,
          "network_mbps": 1000.0}


def sample(mtype: MsgType) -> p.Message:
    """One valid message of each type, with tensors where the type carries them."""
    t = {
        MsgType.HELLO: lambda: make(mtype, node="a", incarnation=7, address="127.0.0.1:7700", device=DEVICE,
                                    roles=["decode"]),
        MsgType.PEERS: lambda: make(mtype, node="a", peers=[{"id": "b", "address": "h:1", "incarnation": 3}]),
        MsgType.HEARTBEAT: lambda: make(mtype, node="a", incarnation=7, seq=12, load={"queue": 0}),
        MsgType.LEAVE: lambda: make(mtype, node="a", incarnation=7),
        MsgType.STATUS_REQ: lambda: make(mtype),
        MsgType.STATUS_REP: lambda: make(mtype, status={"node": "a", "peers": []}),
        MsgType.ERROR: lambda: make(mtype, code="duplicate_id", message="id 'a' is taken"),
        MsgType.PING: lambda: make(mtype),
        MsgType.PONG: lambda: make(mtype),
        MsgType.ACTIVATIONS: lambda: make(mtype, tensors={"hidden": torch.randn(5, 16)}, replica=1, batch=9,
                                          plan_version=2, spans=[SPAN.to_wire(), SPAN.to_wire()], ship=[[7, 2]],
                                          verify=[[11, [1, 2]]]),
        MsgType.KV_TRANSFER: lambda: make(mtype, tensors={"k": torch.randn(2, 3, 4, 8).to(torch.bfloat16),
                                                          "v": torch.randn(2, 3, 4, 8).to(torch.bfloat16)},
                                          seq=11, layers=[0, 2], length=4, replica=1, plan_version=2),
        MsgType.DRAFT: lambda: make(mtype, tenant="t1", seq=11, block=3, start=17, after=5, hash=123, tokens=[1, 2, 3, 4],
                                    plan_version=2),
        MsgType.VERDICT: lambda: make(mtype, tenant="t1", seq=11, block=3, accepted=2, tokens=[1, 2, 99],
                                      context=20, hash=77, replica=1, finished=False),
        MsgType.CAPACITY: lambda: make(mtype, node="d1", replica=0, free_slots=4, queue=1, plan_version=2),
        MsgType.GENERATE_REQ: lambda: make(mtype, seq=11, prompt_token_ids=[1, 2], max_tokens=8,
                                           sampling=sampling_map(0.8, 0, 0.9, 5), stop_ids=[2],
                                           decode_replica=1, gateway="127.0.0.1:7700", drafter="", plan_version=2),
        MsgType.TOKENS: lambda: make(mtype, seq=11, token_ids=[5, 6], index=3, finished=True,
                                     finish_reason="length"),
        MsgType.KV_ACK: lambda: make(mtype, seq=11, node="d1", length=12, plan_version=2),
        MsgType.RESULTS: lambda: make(mtype, replica=1, batch=9, plan_version=2, out=[[11, [5], [0.25]]]),
        MsgType.HANDOFF: lambda: make(mtype, seq=11, prompt_len=12, tokens=[5], max_tokens=8,
                                      sampling=sampling_map(0, 0, 1.0, 0), stop_ids=[], gateway="h:1",
                                      drafter="e1", plan_version=2),
        MsgType.RELEASE: lambda: make(mtype, seq=11, reason="finished"),
        MsgType.KV_RESERVE: lambda: make(mtype, seq=11, replica=1, positions=512, plan_version=3),
        MsgType.KV_GRANT: lambda: make(mtype, seq=11, granted=True),
        MsgType.PLAN: lambda: make(mtype, version=3, coordinator="a", plan={"replicas": []}, addresses={"a": "h:1"},
                                         incarnations={"a": 1}, model_id="4d1e1533028f7a12"),
        MsgType.FAULT: lambda: make(mtype, zones=["edge", "fog"], seconds=2.5),
        MsgType.SESSION: lambda: make(mtype, seq=11, prompt_token_ids=[1, 2], max_tokens=8,
                                      sampling=sampling_map(0, 0, 1.0, 0), stop_ids=[2], decode_replica=1, gamma=4,
                                      adaptive=True, mode="async", gateway="h:1", plan_version=2),
        MsgType.WEIGHTS_INDEX_REQ: lambda: make(mtype, model="smollm2-135m"),
        MsgType.WEIGHTS_INDEX: lambda: make(mtype, model="smollm2-135m", fingerprint="ab" * 32,
                                            args={"dim": 576, "n_layers": 30, "tie_embeddings": True},
                                            directory={"blk.0.attn_q.weight": [3, [576, 576], 207360]}),
        MsgType.WEIGHTS_REQ: lambda: make(mtype, model="smollm2-135m", fingerprint="ab" * 32, fetch=5,
                                          tensor="blk.0.attn_q.weight", offset=65536, length=65536,
                                          reply_to="127.0.0.1:7702"),
        MsgType.WEIGHTS_CHUNK: lambda: make(mtype, tensors={"data": np.arange(300, dtype=np.uint8)},
                                            model="smollm2-135m", fetch=5, tensor="blk.0.attn_q.weight",
                                            offset=65536, total=207360, sha256="cd" * 32),
    }
    return t[mtype]()


def roundtrip(msg: p.Message) -> p.Message:
    return decode([bytes(f) for f in encode(msg)])


@pytest.mark.parametrize("mtype", list(MsgType))
def test_every_type_roundtrips(mtype: MsgType) -> None:
    msg = sample(mtype)
    msg.src, msg.zone, msg.rid = "node-x", "fog", 42
    back = roundtrip(msg)
    assert back.type is mtype and back.fields == msg.fields
    assert (back.src, back.zone, back.rid) == ("node-x", "fog", 42)
    assert back.tensors.keys() == msg.tensors.keys()
    for name, buf in msg.tensors.items():
        assert back.tensors[name].dtype == buf.dtype and back.tensors[name].shape == buf.shape
        assert bytes(back.tensors[name].data) == bytes(buf.data)


def test_schema_covers_every_type() -> None:
    assert set(p.SCHEMAS) == set(MsgType)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_torch_tensors_of_each_dtype(dtype: torch.dtype) -> None:
    x = (torch.randn(3, 4, 5) * 50).to(dtype)
    msg = make(MsgType.ACTIVATIONS, tensors={"hidden": x}, replica=0, batch=0, plan_version=0, spans=[], ship=[], verify=[])
    y = roundtrip(msg).tensors["hidden"].torch()
    assert y.dtype == dtype and torch.equal(x, y)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int64", "int32", "int8", "uint8", "uint16",
                                   "bool"])
def test_numpy_tensors_of_each_dtype(dtype: str) -> None:
    x = (np.random.rand(2, 7) * 100).astype(dtype)
    back = roundtrip(make(MsgType.KV_TRANSFER, tensors={"k": np.zeros((0, 0), np.int32), "v": x}, seq=0,
                          layers=[0, 1], length=0, replica=0, plan_version=0))
    np.testing.assert_array_equal(back.tensors["v"].numpy(), x)


def test_empty_and_noncontiguous_tensors() -> None:
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # not contiguous
    back = roundtrip(make(MsgType.KV_TRANSFER, tensors={"k": x, "v": torch.zeros(0, 3)}, seq=0, replica=0, plan_version=0,
                          layers=[0, 1], length=0))
    assert torch.equal(back.tensors["k"].torch(), x) and back.tensors["v"].torch().shape == (0, 3)


def test_tensor_frames_are_zero_copy() -> None:
    x = np.ones((1024,), dtype=np.float32)
    frames = encode(make(MsgType.ACTIVATIONS, tensors={"hidden": x}, replica=0, batch=0, plan_version=0, spans=[], ship=[], verify=[]))
    x[0] = 5.0
    assert np.frombuffer(frames[1], dtype=np.float32)[0] == 5.0


def test_make_checks_fields_and_tensors() -> None:
    with pytest.raises(ProtocolError, match="missing field 'seq'"):
        make(MsgType.HEARTBEAT, node="a", incarnation=1, load={})
    with pytest.raises(ProtocolError, match="field 'incarnation' has type str"):
        make(MsgType.LEAVE, node="a", incarnation="1")
    with pytest.raises(ProtocolError, match="tensors must be"):
        make(MsgType.ACTIVATIONS, replica=0, batch=0, plan_version=0, spans=[], ship=[], verify=[])
    with pytest.raises(ProtocolError, match="reserved"):
        make(MsgType.PING, zone="x")


def frames_of(mtype: MsgType = MsgType.HEARTBEAT) -> list[bytes]:
    return [bytes(f) for f in encode(sample(mtype))]


@pytest.mark.parametrize("mutate, match", [
    (lambda f: [], "no frames"),
    (lambda f: [b"MLL"], "shorter than"),
    (lambda f: [b"XXXX" + f[0][4:]], "bad magic"),
    (lambda f: [f[0][:4] + bytes([9]) + f[0][5:]], "unsupported protocol version 9"),
    (lambda f: [f[0][:5] + bytes([200]) + f[0][6:]], "unknown message type 200"),
    (lambda f: [f[0][:8] + b"\xc1"], "not valid msgpack"),
    (lambda f: [f[0][:8] + msgpack.packb([1, 2])], "must be a msgpack map"),
    (lambda f: [f[0], b"extra"], "preamble says 0 tensor frames, got 1"),
    (lambda f: [f[0][:6] + struct.pack(">H", 999) + f[0][8:]], "exceeds MAX_TENSORS"),
])
def test_decode_errors_say_what_is_wrong(mutate, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(mutate(frames_of()))


def test_decode_rejects_bad_tensor_descriptors() -> None:
    f = frames_of(MsgType.ACTIVATIONS)
    with pytest.raises(ProtocolError, match="needs .* bytes, frame has"):
        decode([f[0], f[1][:-4]])
    head = msgpack.unpackb(f[0][8:])
    for bad, match in [({"dtype": "complex64", "shape": [5, 16]}, "unknown dtype"),
                       ({"dtype": "float32", "shape": [-1, 16]}, "non-negative"),
                       ({"dtype": "float32", "shape": [2**40, 2**40]}, "larger than MAX_MESSAGE_BYTES"),
                       ("nope", "descriptor must be a map")]:
        h = dict(head, t=[bad])
        with pytest.raises(ProtocolError, match=match):
            decode([f[0][:8] + msgpack.packb(h), f[1]])


def test_size_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p, "MAX_MESSAGE_BYTES", 1000)
    big = make(MsgType.ACTIVATIONS, tensors={"hidden": np.zeros(1000, np.float32)}, replica=0, batch=0, plan_version=0, ship=[], verify=[],
               spans=[])
    with pytest.raises(ProtocolError, match="exceeds MAX_MESSAGE_BYTES"):
        encode(big)
    with pytest.raises(ProtocolError, match="exceeds MAX_MESSAGE_BYTES"):
        decode([b"MLLM" + b"\0" * 2000])


def test_never_unpickles() -> None:
    import pickle

    evil = pickle.dumps({"x": 1})
    with pytest.raises(ProtocolError):
        decode([evil])
    f = frames_of()
    with pytest.raises(ProtocolError):  # msgpack ext types (where pickles could hide) are refused
        decode([f[0][:8] + msgpack.packb({"node": msgpack.ExtType(1, evil)})])


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.lists(st.binary(max_size=256), max_size=4))
def test_fuzz_random_bytes(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except ProtocolError:
        pass


@FUZZ
@given(st.sampled_from(list(MsgType)), st.data())
def test_fuzz_mutated_valid_frames(mtype: MsgType, data: st.DataObject) -> None:
    frames = frames_of(mtype)
    i = data.draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[i])
    for _ in range(data.draw(st.integers(1, 8))):
        if not raw:
            break
        pos = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[pos:pos + data.draw(st.integers(1, 16))]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    frames[i] = bytes(raw)
    if data.draw(st.booleans()):
        frames = frames[: data.draw(st.integers(0, len(frames)))]
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert isinstance(msg, p.Message)  # a mutation can still be a valid message; then it decodes cleanly


@FUZZ
@given(st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.text(max_size=8),
                                                     st.lists(st.booleans(), max_size=3)), max_size=6),
       st.sampled_from(list(MsgType)))
def test_fuzz_random_headers(head: dict, mtype: MsgType) -> None:
    try:
        decode([p.PREAMBLE.pack(p.MAGIC, p.VERSION, int(mtype), 0) + msgpack.packb(head)])
    except ProtocolError:
        pass


# -- the checks of network fields, one by one (a fuzzer shows a handler survives; these show what is refused)
GOOD_SPAN = [7, 0, 3, int(p.SpanKind.PREFILL_LAST), 0, 0.7, 40, 0.9, 11]


@pytest.mark.parametrize("field, bad", [
    (0, -1), (0, 1 << 63), (0, 1.0), (1, -1), (2, 0), (2, -2), (3, 4), (3, -1), (4, -1), (5, -0.5),
    (5, float("nan")), (5, "0"), (6, -1), (6, 2.0), (7, 0.0), (7, -0.1), (7, 1.5), (7, float("nan")),
    (8, 1.5), (8, None), (2, True)])
def test_a_span_field_out_of_range_is_a_protocol_error(field: int, bad) -> None:
    """A span's fields (seq, start, n, kind, index, temperature, top_k, top_p, seed) are held to
    their ranges: a negative top_k or a top_p of 0 reached the last stage's sampling (a
    RuntimeError, or NaN probabilities) where they should be dropped as a malformed frame."""
    assert p.WireSpan.from_wire(GOOD_SPAN).to_wire() == GOOD_SPAN
    span = list(GOOD_SPAN)
    span[field] = bad
    with pytest.raises(ProtocolError, match="bad span"):
        p.WireSpan.from_wire(span)


def test_a_span_of_another_length_is_a_protocol_error() -> None:
    for span in (GOOD_SPAN[:8], GOOD_SPAN + [0], tuple(GOOD_SPAN[:3]), "span", None):
        with pytest.raises(ProtocolError, match="span must be a list of 9 fields"):
            p.WireSpan.from_wire(span)


@pytest.mark.parametrize("change", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": True}, {"top_k": -1}, {"top_k": 1.5},
    {"top_p": 0.0}, {"top_p": 1.01}, {"top_p": float("nan")}, {"seed": 1.5}, {"seed": None}, {"extra": 1}])
def test_a_sampling_map_out_of_range_or_with_other_keys_is_a_protocol_error(change: dict) -> None:
    from meshllm.mesh.fields import check_sampling

    good = sampling_map(0.7, 40, 0.9, 11)
    assert check_sampling(good) == (0.7, 40, 0.9, 11) and check_sampling(sampling_map(0, 0, 1.0, -5))[3] == -5
    with pytest.raises(ProtocolError):
        check_sampling({**good, **change})
    missing = dict(good)
    missing.pop("seed")
    with pytest.raises(ProtocolError, match="exactly"):
        check_sampling(missing)


def test_list_caps_and_port_ranges_hold_at_their_edges() -> None:
    """An off-by-one in any cap (prompt ids, drafts, stop ids) or port check went unnoticed."""
    from meshllm.mesh.fields import NODE_PORT_MAX, check_int_list, is_address

    assert check_int_list([1] * 64, "draft", max_len=64) == [1] * 64
    with pytest.raises(ProtocolError, match="at most 64"):
        check_int_list([1] * 65, "draft", max_len=64)
    assert check_int_list([0, 9], "ids", 0, 9) == [0, 9]
    for bad in ([-1], [10], [1.0], [True]):
        with pytest.raises(ProtocolError):
            check_int_list(bad, "ids", 0, 9)
    assert NODE_PORT_MAX == 65534  # PUB is PORT + 1
    assert is_address("127.0.0.1:1") and is_address(f"127.0.0.1:{NODE_PORT_MAX}") and is_address("[::1]:7000")
    for bad in ("127.0.0.1:0", "127.0.0.1:65535", "127.0.0.1:99999", "127.0.0.1", ":7000", 7000, "a b:1"):
        assert not is_address(bad), bad
