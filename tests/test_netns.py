"""A real multi-host mesh: network namespaces joined by a bridge, one node per namespace.

Five namespaces, all made by this test and named after its pid: a "switch" namespace holding a
Linux bridge (and the test's HTTP client, at .254), and four node namespaces, each joined to the
bridge by a veth pair and given its own address in a private /24 chosen per run. No interface,
address or route of the host is touched: the veths are created inside the namespaces.

    a-fog   fog   gateway only (roles: [gateway]); mDNS on; no seeds      -> the coordinator (lowest id)
    b-fog   fog   stage host; seeds: [a]; mDNS off
    c-edge  edge  drafter (W4A16 g64, async speculation); seeds: [a]; mDNS off
    d-fog   fog   stage host; mDNS on; no seeds      -> only mDNS, across the veths, can find it

Every node listens on 0.0.0.0:7700 and advertises its namespace address (d-fog listens on the
address itself). The edge<->fog path gets a 150 ms round trip: `tc netem` on the edge veth and its
bridge port where the kernel has netem, otherwise the transport's own link shaping (`links:` in
every node file, applied by each receiver to messages from the other zone). The test prints which
was used and measures it with PINGs from the edge namespace (loosely: >= 100 ms).

It then generates through the gateway (greedy, drafts published by the edge drafter and verified
in the fog) and compares with the single-process reference (the tie rule of engine/sampling.py). Teardown (kill
every node's process group, delete the namespaces and with them the bridge and veths) runs in a
`finally`, whatever happened. Skipped, with the reason, when not root, without `ip`, or when
`ip netns add` fails; CI runs as root and runs it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, spawn
from tests.serving_util import reference, same_up_to_tie

pytestmark = pytest.mark.slow

PREFIX = "mllmt"  # namespaces: mllmt<pid>-<name>; a leftover of a dead pid is removed at the next run
PORT, GW_PORT = 7700, 8000
RTT_MS = 150.0
READY_TIMEOUT_S = 300  # node processes import torch and load layers on a 2-core machine
DEVICE = {"name": "box", "memory_gb": 8, "compute_tflops": 1, "memory_bandwidth_gbps": 60, "network_mbps": 1000,
          "source": "netns test profile"}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]
MAX_TOKENS = 16

# node name -> (host number in the /24, zone, node-file extras)
NODES = {
    "a": (1, "fog", {"id": "a-fog", "roles": ["gateway"], "mdns": True, "seeds": []}),
    "b": (2, "fog", {"id": "b-fog", "mdns": False, "seeds": ["a"]}),
    "c": (3, "edge", {"id": "c-edge", "device": "raspberry-pi-5-8gb", "roles": ["drafter"], "mdns": False,
                      "seeds": ["a"]}),
    "d": (4, "fog", {"id": "d-fog", "mdns": True, "seeds": [], "listen_on_address": True}),
}


def run(*cmd: str, timeout: float = 20, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def netns_unavailable() -> str | None:
    """Why this test cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (.ci/run installs it when run as root)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        r = run("ip", "netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` failed: {e}"
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return None


def remove_stale_namespaces() -> None:
    """Namespaces of an earlier run of this test that was killed before its teardown."""
    listing = run("ip", "netns", "list", check=False).stdout
    for name in re.findall(rf"^({PREFIX}(\d+)-\S+)", listing, re.M):
        ns, pid = name[0], int(name[1])
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            kill_namespace_processes(ns)
            run("ip", "netns", "del", ns, check=False)


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL what still runs inside a namespace this test made (every one of them is ours)."""
    r = run("ip", "netns", "pids", ns, check=False, timeout=10)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Lab:
    """The namespaces, the bridge, the veths and the node processes of one run."""

    def __init__(self, tmp: Path):
        self.tmp, self.pid = tmp, os.getpid()
        self.net = f"10.77.{self.pid % 200 + 20}"  # per run; it exists only inside our namespaces
        self.namespaces: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.delay = "none"
        self.notes: list[str] = []  # printed at the end, even with -q

    def note(self, line: str) -> None:
        self.notes.append(line)
        print(f"netns test: {line}")

    def ns(self, name: str) -> str:
        return f"{PREFIX}{self.pid}-{name}"

    def addr(self, name: str) -> str:
        return f"{self.net}.{NODES[name][0]}"

    def sh(self, name: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return run("ip", "netns", "exec", self.ns(name), *cmd, check=check)

    # -- the network ---------------------------------------------------------------------
    def build(self) -> None:
        remove_stale_namespaces()
        for name in ["sw", *NODES]:
            run("ip", "netns", "add", self.ns(name))
            self.namespaces.append(self.ns(name))
            run("ip", "-n", self.ns(name), "link", "set", "lo", "up")
        sw = self.ns("sw")
        run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", sw, "addr", "add", f"{self.net}.254/24", "dev", "br0")
        run("ip", "-n", sw, "link", "set", "br0", "up")
        for name in NODES:
            # both ends are created inside namespaces: the host's own links never see them
            run("ip", "-n", sw, "link", "add", f"p-{name}", "type", "veth", "peer", "name", "eth0",
                "netns", self.ns(name))
            run("ip", "-n", sw, "link", "set", f"p-{name}", "master", "br0")
            run("ip", "-n", sw, "link", "set", f"p-{name}", "up")
            run("ip", "-n", self.ns(name), "addr", "add", f"{self.addr(name)}/24", "dev", "eth0")
            run("ip", "-n", self.ns(name), "link", "set", "eth0", "up")

    def try_netem(self) -> bool:
        """Half the round trip on the edge node's veth, half on its bridge port: only edge traffic
        is delayed. False (nothing changed) where the kernel or iproute2 has no netem."""
        if shutil.which("tc") is None:
            return False
        half = f"{RTT_MS / 2:g}ms"
        first = self.sh("c", "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", half, check=False)
        if first.returncode != 0:
            self.note(f"no netem here: {first.stderr.strip()}")
            return False
        self.sh("sw", "tc", "qdisc", "add", "dev", "p-c", "root", "netem", "delay", half)
        return True

    # -- the nodes -----------------------------------------------------------------------
    def node_file(self, name: str, links: list[dict]) -> Path:
        num, zone, extra = NODES[name]
        extra = dict(extra)
        on_address = extra.pop("listen_on_address", False)
        seeds = extra.pop("seeds")
        cfg = {"device": DEVICE, "zone": zone, "model": "smollm2-135m", "plan_settle_s": 1.0,
               "listen": f"{self.addr(name)}:{PORT}" if on_address else f"0.0.0.0:{PORT}",
               "advertise": f"{self.addr(name)}:{PORT}",
               "seeds": [f"{self.addr(s)}:{PORT}" for s in seeds],
               "speculation": {"mode": "async", "gamma": 4}, "draft": {"quant": "w4a16", "group_size": 64},
               "links": links, **extra}
        if name == "a":
            cfg["gateway"] = {"listen": f"{self.addr('a')}:{GW_PORT}"}
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def start(self, name: str, links: list[dict]) -> None:
        path = self.node_file(name, links)
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs[name] = spawn(
            ["ip", "netns", "exec", self.ns(name), sys.executable, str(REPO / "launch.py"), "--node-config",
             str(path)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=log,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        log.close()

    def logs(self, chars: int = 2500) -> str:
        out = []
        for name in NODES:
            p = self.tmp / f"{name}.log"
            text = p.read_text(errors="replace") if p.exists() else ""
            rc = self.procs[name].poll() if name in self.procs else None
            out.append(f"--- {name} (exit {rc}) ---\n{text[-chars:]}")
        return "\n".join(out)

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        assert not dead, f"node processes exited early: {dead}\n{self.logs()}"

    # -- clients inside the namespaces ---------------------------------------------------
    def python(self, name: str, code: str, *args: str, timeout: float = 60) -> dict:
        r = subprocess.run(["ip", "netns", "exec", self.ns(name), sys.executable, "-c", code, *args], cwd=REPO,
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"client in {name} exited {r.returncode}: {r.stderr[-2000:]}")
        out = r.stdout.strip()
        try:
            return json.loads(out)
        except ValueError:
            return json.loads(out.splitlines()[-1])

    def http(self, method: str, path: str, body: dict | None = None, timeout: float = 10) -> tuple[int, dict]:
        """An HTTP call to the gateway from the switch namespace (the "laptop" on the LAN)."""
        url = f"http://{self.addr('a')}:{GW_PORT}{path}"
        out = self.python("sw", HTTP_CLIENT, method, url, json.dumps(body), str(timeout), timeout=timeout + 30)
        return out["status"], out["body"]

    # -- teardown ------------------------------------------------------------------------
    def teardown(self) -> None:
        """SIGTERM every node's process group (a clean leave), SIGKILL what is left after 30 s,
        then delete the namespaces (the bridge and the veths go with them). Every step runs
        even if an earlier one failed."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        for ns in reversed(self.namespaces):
            try:
                kill_namespace_processes(ns)
                run("ip", "netns", "del", ns, check=False)
            except (OSError, subprocess.TimeoutExpired) as e:
                print(f"netns test: could not remove namespace {ns}: {e}", file=sys.stderr)
        self.namespaces.clear()


HTTP_CLIENT = r"""
import json, sys, urllib.error, urllib.request
method, url, body, timeout = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
data = None if body is None else json.dumps(body).encode()
req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
        status, raw = r.status, r.read()
except urllib.error.HTTPError as e:
    status, raw = e.code, e.read()
except OSError as e:
    status, raw = 0, json.dumps({"error": str(e)}).encode()
try:
    out = json.loads(raw or b"{}")
except ValueError:
    out = {"raw": raw.decode(errors="replace")}
print(json.dumps({"status": status, "body": out}))
"""

# PINGs to a node from a Transport in this namespace, in `zone`, with the same links as the nodes:
# the node holds each PING back as the edge<->fog link would, and so does the probe each PONG.
PING_PROBE = r"""
import json, statistics, sys, time
from meshllm.config import LinkSpec
from meshllm.mesh.protocol import MsgType, make
from meshllm.mesh.ingress import LinkShaper
from meshllm.mesh.transport import Transport
zone, listen, target, links = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
links = tuple(LinkSpec(tuple(ln["zones"]), ln["rtt_ms"], ln["bandwidth_mbps"]) for ln in links)
t = Transport("probe-" + zone, zone, listen, LinkShaper(zone, links))
t.start()
try:
    t.request(target, make(MsgType.PING), 10)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        t.request(target, make(MsgType.PING), 10)
        times.append((time.perf_counter() - t0) * 1e3)
finally:
    t.close_thread_sockets()
    t.close()
print(json.dumps({"median_ms": statistics.median(times), "all_ms": times}))
"""


def wait_for(what: str, lab: Lab, check, timeout_s: float, every_s: float = 1.0):
    """Poll `check()` until it returns something truthy (bounded in time and count)."""
    deadline = time.monotonic() + timeout_s
    last = None
    for _ in range(int(timeout_s / every_s) + 10):
        lab.check_alive()
        try:
            last = check()
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            break
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:g} s (last: {last!r})\n{lab.logs()}")


@pytest.fixture
def lab(tmp_path, capsys):
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    lab = Lab(tmp_path)
    try:
        yield lab
    finally:
        lab.teardown()
        with capsys.disabled():
            print("".join(f"\nnetns test: {line}" for line in lab.notes) + "\nnetns test: torn down")


def test_nodes_in_separate_network_namespaces_find_each_other_and_generate(lab, smollm2, smollm2_tokenizer):
    # the references first, on a quiet machine (this process's first forward pass is the slow one)
    refs = {p: reference(smollm2, smollm2_tokenizer, p, MAX_TOKENS) for p in PROMPTS}
    t0 = time.monotonic()
    lab.build()
    netem = lab.try_netem()
    edge_fog = {"zones": ["edge", "fog"], "rtt_ms": RTT_MS, "bandwidth_mbps": 100}
    links = [] if netem else [edge_fog]
    lab.delay = (f"tc netem ({RTT_MS:g} ms round trip on the edge veth and its bridge port)" if netem else
                 f"the transport's link shaping (links: edge<->fog rtt_ms {RTT_MS:g}; no netem in this kernel)")
    lab.note(f"edge<->fog delay by {lab.delay}")
    for name in NODES:
        lab.start(name, links)

    # discovery: b and c know a from their seeds; d is nobody's seed and has none, so only mDNS
    # (zeroconf on the bridge, between d and a) can bring it in
    ids = {n: NODES[n][2]["id"] for n in NODES}

    def everyone_seen():
        code, view = lab.http("GET", "/v1/mesh")
        nodes = view.get("nodes", {}) if code == 200 else {}
        return view if all(nodes.get(ids[n], {}).get("state") == "alive" for n in NODES) else None

    view = wait_for("the gateway node sees every node alive (d-fog through mDNS)", lab, everyone_seen, 120)
    for n, (_, zone, _) in NODES.items():
        node = view["nodes"][ids[n]]
        assert node["address"] == f"{lab.addr(n)}:{PORT}", (n, node)  # the advertise address, not 0.0.0.0
        assert node["zone"] == zone, (n, node)
    t_joined = time.monotonic() - t0

    def planned_and_ready():
        code, health = lab.http("GET", "/health")
        if code != 200:
            return None
        _, plan = lab.http("GET", "/v1/plan")
        p = plan.get("plan", {})
        stages = {s["node"] for r in p.get("replicas", []) for s in r["stages"]}
        planned = stages | set(p.get("unused", ()))  # a plan made after b and d had both joined
        if plan.get("version") != health["plan_version"] or not stages or not stages <= {ids["b"], ids["d"]}:
            return None
        return p if {ids["b"], ids["d"]} <= planned and p.get("drafters") == [ids["c"]] else None

    plan = wait_for("a plan over the fog nodes with c-edge drafting, every part loaded", lab, planned_and_ready,
                    READY_TIMEOUT_S)
    t_ready = time.monotonic() - t0

    # the mDNS-only node, asked with the CLI from another namespace, knows the whole mesh
    st = lab.python("b", "import sys; from meshllm.launch import main; sys.exit(main())", "--status",
                    f"{lab.addr('d')}:{PORT}", "--json", timeout=60)
    peers = {p["id"]: p for p in st["peers"]}
    assert st["node"] == ids["d"] and st["address"] == f"{lab.addr('d')}:{PORT}", st
    for n in ("a", "b", "c"):
        assert peers[ids[n]]["state"] == "alive" and peers[ids[n]]["address"] == f"{lab.addr(n)}:{PORT}", st

    # the delay on the edge<->fog path, measured from the edge namespace (and, for contrast, fog<->fog)
    target = f"{lab.addr('a')}:{PORT}"
    edge = lab.python("c", PING_PROBE, "edge", f"{lab.addr('c')}:{PORT + 10}", target, json.dumps(links))
    fog = lab.python("b", PING_PROBE, "fog", f"{lab.addr('b')}:{PORT + 10}", target, json.dumps(links))
    lab.note(f"PING round trip edge->fog {edge['median_ms']:.1f} ms, fog->fog {fog['median_ms']:.1f} ms")
    assert edge["median_ms"] >= 100, (lab.delay, edge)

    # generate through the mesh: gateway in a, stages in b and d, drafts from c across the edge link
    for prompt in PROMPTS:
        body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        t_req = time.monotonic()
        code, res = lab.http("POST", "/v1/completions", body, timeout=180)
        spec = (res.get("meshllm") or {}).get("spec") or {}
        lab.note(f"{prompt!r}: {time.monotonic() - t_req:.1f} s, {spec.get('blocks')} draft blocks verified, "
                 f"{spec.get('accepted')}/{spec.get('drafted')} drafted tokens accepted")
        assert code == 200, f"{res}\n{lab.logs()}"
        ok, why = same_up_to_tie(res["choices"][0]["token_ids"], refs[prompt])
        assert ok, f"{prompt!r}: {why}"
        assert spec.get("blocks", 0) > 0, f"no drafts from the edge were verified: {res['meshllm']}"
    lab.note(f"joined in {t_joined:.1f} s, serving in {t_ready:.1f} s, plan "
             f"{[[s['node'] for s in r['stages']] for r in plan['replicas']]}, drafters {plan['drafters']}; "
             f"done in {time.monotonic() - t0:.1f} s")

    # a clean leave: SIGTERM, every node exits 0
    procs = dict(lab.procs)
    lab.teardown()
    assert all(p.returncode == 0 for p in procs.values()), {n: p.returncode for n, p in procs.items()}
