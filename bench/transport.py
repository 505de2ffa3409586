"""Transport benchmark: link shaping accuracy, and meshllm ROUTER vs raw pyzmq, side by side.

    python bench/transport.py            # full run (~1 min)
    python bench/transport.py --quick    # fewer messages

1. Link shaping: median of 20 request/replies between zones with rtt_ms=80
   (goal: 80 ms ± 10%) and within one zone (goal: unaffected, < 5 ms).
2. Loopback ROUTER round-trip latency (median) and one-way throughput of 4 KB
   and 1 MB tensor messages: meshllm Transport (encode/decode, I/O thread,
   handlers) vs raw pyzmq DEALER->ROUTER with the same bytes, in the same run,
   interleaved. Each server runs in its own process, as a peer node does; the
   throughput clock stops when a flush message sent after the last one is
   answered. Goals: >= 0.9x raw throughput, <= 100 us added latency.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshllm.config import LinkSpec  # noqa: E402
from meshllm.mesh.ingress import LinkShaper  # noqa: E402
from meshllm.mesh.protocol import Message, MsgType, encode, make  # noqa: E402
from meshllm.mesh.sockets import endpoint, free_port_pair  # noqa: E402
from meshllm.mesh.transport import Transport  # noqa: E402

SIZES = {"4 KB": 4 * 1024, "1 MB": 1024 * 1024}


def addr() -> str:
    return f"127.0.0.1:{free_port_pair()}"


def activation(nbytes: int, echo: bool = False) -> Message:
    """An ACTIVATIONS message as the wire carries one (protocol v2); batch 1 asks the bench's
    server for an echo, batch 0 is sunk."""
    return make(MsgType.ACTIVATIONS, tensors={"hidden": np.ones(nbytes // 4, np.float32)}, replica=0,
                batch=int(echo), plan_version=0, ship=[], verify=[], spans=[])


# -- link shaping -----------------------------------------------------------------------------
def bench_shaping(n: int = 20) -> tuple[float, float]:
    links = (LinkSpec(("edge", "fog"), 80.0, 1000.0),)
    nodes = {k: Transport(k, z, addr(), LinkShaper(z, links)) for k, z in
             (("fog", "fog"), ("edge", "edge"), ("fog2", "fog"))}
    addrs = {k: t.router.getsockopt(zmq.LAST_ENDPOINT).decode().removeprefix("tcp://") for k, t in nodes.items()}
    for t in nodes.values():
        t.on(MsgType.PING, lambda m, reply: reply(make(MsgType.PONG)))
        t.start()
    try:
        def median_ms(src: str, dst: str) -> float:
            nodes[src].request(addrs[dst], make(MsgType.PING), 10)
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                nodes[src].request(addrs[dst], make(MsgType.PING), 10)
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)

        return median_ms("edge", "fog"), median_ms("fog2", "fog")
    finally:
        for t in nodes.values():
            t.close_thread_sockets()
            t.close()


# -- servers: each in its own process, as a peer node would be --------------------------------
def raw_server(address: str) -> None:
    """ROUTER that echoes every message, except b"flush", which it acks (all before it were read)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint(address))
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"flush":
            sock.send_multipart([frames[0], b"ack"])
        elif len(frames) > 2 and frames[1].bytes[-1:] == b"\x01":  # the echo flag, see raw_frames
            sock.send_multipart(frames, copy=False)


def mesh_server(address: str) -> None:
    """A meshllm Transport: ACTIVATIONS of batch 1 are echoed, of batch 0 sunk; PING answers PONG."""
    t = Transport("server", "z", address)

    def on_act(m: Message, reply) -> None:
        if m["batch"] == 1:
            reply(make(MsgType.ACTIVATIONS, tensors=m.tensors, **m.fields))

    t.on(MsgType.ACTIVATIONS, on_act)
    t.on(MsgType.PING, lambda m, reply: reply(make(MsgType.PONG)))
    t.start()
    while True:
        time.sleep(3600)


def raw_frames(nbytes: int, echo: bool) -> list:
    """The same bytes a meshllm message carries, plus a 1-byte echo flag on the header frame."""
    frames = encode(activation(nbytes))
    return [bytes(frames[0]) + (b"\x01" if echo else b"\x00"), *frames[1:]]


# -- clients ------------------------------------------------------------------------------------
def raw_rtt_us(sock: zmq.Socket, nbytes: int, n: int) -> float:
    frames = raw_frames(nbytes, echo=True)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send_multipart(frames, copy=False)
        sock.recv_multipart(copy=False)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def raw_throughput_mbs(sock: zmq.Socket, nbytes: int, n: int) -> float:
    frames = raw_frames(nbytes, echo=False)
    t0 = time.perf_counter()
    for _ in range(n):
        sock.send_multipart(frames, copy=False)
    sock.send(b"flush")
    sock.recv()
    return n * nbytes / (time.perf_counter() - t0) / 1e6


def mesh_rtt_us(t: Transport, address: str, nbytes: int, n: int) -> float:
    msg = activation(nbytes, echo=True)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        t.request(address, msg, timeout_s=10)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def mesh_throughput_mbs(t: Transport, address: str, nbytes: int, n: int) -> float:
    msg = activation(nbytes)  # batch 0: sunk
    t0 = time.perf_counter()
    for _ in range(n):
        t.send(address, msg)
    t.request(address, make(MsgType.PING), timeout_s=60)  # FIFO: every message before it was handled
    return n * nbytes / (time.perf_counter() - t0) / 1e6


def start_servers() -> tuple[list[mp.Process], str, str]:
    ctx = mp.get_context("spawn")
    raw_addr, mesh_addr = addr(), addr()
    procs = [ctx.Process(target=raw_server, args=(raw_addr,), daemon=True),
             ctx.Process(target=mesh_server, args=(mesh_addr,), daemon=True)]
    for p in procs:
        p.start()
    return procs, raw_addr, mesh_addr


def report(label: str, nbytes: int, raw: zmq.Socket, client: Transport, mesh_addr: str, scale: float,
           repeats: int) -> None:
    n_rtt = int((2000 if nbytes < 65536 else 300) * scale)
    n_tp = int((20000 if nbytes < 65536 else 2000) * scale)
    rr, mr, rt, mt = [], [], [], []
    for _ in range(repeats):  # interleaved so drift hits both alike
        rr.append(raw_rtt_us(raw, nbytes, n_rtt))
        mr.append(mesh_rtt_us(client, mesh_addr, nbytes, n_rtt))
        rt.append(raw_throughput_mbs(raw, nbytes, n_tp))
        mt.append(mesh_throughput_mbs(client, mesh_addr, nbytes, n_tp))
    r_rtt, m_rtt = statistics.median(rr), statistics.median(mr)
    r_tp, m_tp = statistics.median(rt), statistics.median(mt)
    added, ratio = m_rtt - r_rtt, m_tp / r_tp
    verdict = f"{'PASS' if added <= 100 else 'FAIL'} / {'PASS' if ratio >= 0.9 else 'FAIL'}"
    print(f"{label:>6} | {r_rtt:10.1f} {m_rtt:11.1f} {added:8.1f} | {r_tp:9.1f} {m_tp:9.1f} {ratio:6.2f} | {verdict}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats; the median is reported")
    args = ap.parse_args()
    scale = 0.2 if args.quick else 1.0

    cross, same = bench_shaping()
    ok = abs(cross - 80.0) <= 8.0 and same < 5.0
    print("link shaping (rtt_ms=80 between zones, median of 20 request/replies)")
    print(f"  cross-zone {cross:7.2f} ms   same-zone {same:6.3f} ms   goal 80 ms +-10% and <5 ms: "
          f"{'PASS' if ok else 'FAIL'}\n")

    procs, raw_addr, mesh_addr = start_servers()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint(raw_addr))
    client = Transport("client", "z", addr())
    client.start()
    try:
        client.request(mesh_addr, make(MsgType.PING), timeout_s=60)  # the server process is up
        raw.send(b"flush")
        raw.recv()
        print(f"{'size':>6} | {'raw rtt us':>10} {'mesh rtt us':>11} {'added us':>8} | {'raw MB/s':>9} "
              f"{'mesh MB/s':>9} {'ratio':>6} | goals (<=100 us, >=0.9x)")
        for label, nbytes in SIZES.items():
            report(label, nbytes, raw, client, mesh_addr, scale, args.repeats)
    finally:
        client.close_thread_sockets()
        client.close()
        raw.close()
        for p in procs:
            p.terminate()
            p.join(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
