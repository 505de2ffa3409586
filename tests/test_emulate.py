"""Local emulation: node files, device-speed pacing, and `--cluster` without orphans."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from meshllm.cluster_run import METRIC_KEYS
from meshllm.config import parse_cluster
from meshllm.defaults import EMULATED_BUSY_POLL_MS
from meshllm.emulate import EmulatedCluster, node_file
from meshllm.node_config import parse_node
from meshllm.roles.pacer import Pacer
from tests.conftest import REPO, run_cli, spawn, wait_for

DEV = {"memory_gb": 8, "compute_tflops": 1, "memory_bandwidth_gbps": 50, "network_mbps": 1000}


def cluster_yaml(tmp: Path, n: int = 3, **extra) -> Path:
    data = {"model": "smollm2-135m",
            "nodes": [{"id": f"n{i}", "device": DEV, "zone": "edge" if i == 0 else "fog"} for i in range(n)],
            "links": [{"zones": ["edge", "fog"], "rtt_ms": 20, "bandwidth_mbps": 100}],
            "workload": {"prompts": ["Hello there"], "max_tokens": 3}, **extra}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_pacer_sleeps_the_difference_only_when_faster_than_predicted() -> None:
    clk = FakeClock()
    pacer = Pacer(clock=clk, sleep=clk.sleep)
    start = clk()
    clk.t += 0.010  # measured 10 ms
    assert pacer.pace(0.050, start) == pytest.approx(0.040)
    assert clk() - start == pytest.approx(0.050)  # the step took what the device would take
    start = clk()
    clk.t += 0.080  # slower than predicted: not stretched
    assert pacer.pace(0.050, start) == 0.0
    assert pacer.steps == 2 and pacer.slept_s == pytest.approx(0.040) and pacer.overrun_s == pytest.approx(0.030)
    off = Pacer(enabled=False, clock=clk, sleep=clk.sleep)
    assert off.pace(1.0, clk()) == 0.0


def test_pacer_step_uses_the_injected_cost_model() -> None:
    clk = FakeClock()
    pacer = Pacer(lambda layers, tokens: layers * tokens * 1e-3, clock=clk, sleep=clk.sleep)
    with pacer.step(10, 5):
        clk.t += 0.02
    assert clk.slept == [pytest.approx(0.03)]


def test_pacer_real_clock_slows_a_fast_step() -> None:
    pacer = Pacer()
    t0 = time.perf_counter()
    pacer.pace(0.05, t0)
    assert time.perf_counter() - t0 >= 0.05


def test_generated_node_files_are_valid_node_configs(tmp_path: Path) -> None:
    cfg = parse_cluster(yaml.safe_load(cluster_yaml(tmp_path).read_text()), "c.yaml")
    for spec in cfg.nodes:
        nc = parse_node(node_file(spec, cfg, "127.0.0.1:7000", "127.0.0.1:7100"), "gen.yaml")
        assert (nc.id, nc.zone, nc.device, nc.mdns, nc.seeds) == (spec.id, spec.zone, spec.device, False,
                                                                   ("127.0.0.1:7100",))
        assert nc.links == cfg.links


def test_judge_reaches_every_coordinator(tmp_path: Path) -> None:
    """`--cluster --judge`: every generated node file asks its coordinator (whichever node it turns
    out to be) to plan with the simulator as its judge; without it none does; a non-boolean is an
    error naming the key."""
    from meshllm.errors import ConfigError

    cfg = parse_cluster(yaml.safe_load(cluster_yaml(tmp_path).read_text()), "c.yaml")
    for spec in cfg.nodes:
        assert parse_node(node_file(spec, cfg, "127.0.0.1:7000", "127.0.0.1:7100", judge=True), "g.yaml").plan_judge
        assert not parse_node(node_file(spec, cfg, "127.0.0.1:7000", "127.0.0.1:7100"), "g.yaml").plan_judge
    bad = {**node_file(cfg.nodes[0], cfg, "127.0.0.1:7000", "127.0.0.1:7100"), "plan_judge": "yes"}
    with pytest.raises(ConfigError, match="plan_judge.*true or false"):
        parse_node(bad, "g.yaml")


def test_only_a_node_alone_on_its_cpu_busy_polls(tmp_path: Path) -> None:
    """Busy-polling a compute queue takes a whole CPU while serving: the emulator asks it of a node
    pinned to a CPU of its own, never of nodes sharing one (they would slow each other down)."""
    cfg = parse_cluster(yaml.safe_load(cluster_yaml(tmp_path).read_text()), "c.yaml")
    alone = EmulatedCluster(cfg, tmp_path / "a", cpus=[0, 1, 2])
    shared = EmulatedCluster(cfg, tmp_path / "s", cpus=[0, 1])  # node i on CPU i % 2
    free = EmulatedCluster(cfg, tmp_path / "f")  # not pinned
    assert [alone.own_cpu(i) for i in range(3)] == [True, True, True]
    assert [shared.own_cpu(i) for i in range(3)] == [False, True, False]
    assert [free.own_cpu(i) for i in range(3)] == [False, False, False]
    listed = EmulatedCluster(cfg, tmp_path / "l", cpus=[0, 1, 1])  # a CPU listed twice is one CPU
    assert [listed.own_cpu(i) for i in range(3)] == [True, False, False]
    polls = [parse_node(node_file(spec, cfg, "127.0.0.1:7000", "127.0.0.1:7100", None, own), "g.yaml").busy_poll_ms
             for spec, own in zip(cfg.nodes, (True, False))]
    assert polls == [EMULATED_BUSY_POLL_MS, 0.0]


def children_of(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_cluster_reports_the_mesh_and_leaves_no_process(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_cli("--cluster", str(cluster_yaml(tmp_path, 4)), "--json", timeout=300, env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object on stdout
    assert len(out["results"]) == 1 and len(out["results"][0]["token_ids"]) == 3
    assert set(METRIC_KEYS) <= set(out["metrics"])
    assert out["plan"]["replicas"]
    for rep in out["plan"]["replicas"]:  # the planner's plan for this cluster, layers covering [0, 30)
        layers = [st["layers"] for st in rep["stages"]]
        assert layers[0][0] == 0 and layers[-1][1] == 30
        assert all(a[1] == b[0] for a, b in zip(layers, layers[1:]))
    nodes = out["mesh"]["nodes"]
    assert [n["id"] for n in nodes] == ["n0", "n1", "n2", "n3"]
    for n in nodes:
        assert sorted(n["peers"]) == sorted({"n0", "n1", "n2", "n3"} - {n["id"]})
        assert n["address"].startswith("127.0.0.1:")
    assert out["mesh"]["formation_s"] > 0
    assert gone([n["pid"] for n in nodes])
    assert list(tmp.iterdir()) == []  # a finished run removes its node files and logs


def test_a_process_the_tests_spawn_ends_when_pytest_is_killed() -> None:
    """A pytest killed from outside (-9 here; `timeout`'s SIGTERM alike) runs no teardown: the `--serve`
    clusters and nodes its fixtures started kept serving for hours. What conftest.spawn starts gets
    SIGTERM when the process that spawned it dies. A middle process stands for pytest."""
    code = ("import sys, time\nfrom tests.conftest import spawn\n"
            "p = spawn([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print(p.pid, flush=True)\ntime.sleep(120)\n")
    middle = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        child = int(middle.stdout.readline())
        # the child is the command itself (same pid), once its death signal is set and it has exec'd
        assert wait_for(lambda: "time.sleep(120)" in " ".join(psutil.Process(child).cmdline()), 30.0)
        middle.kill()
        middle.wait()
        assert gone([child]), "a spawned process outlived the pytest that started it"
    finally:
        middle.kill()
        middle.wait()
        with contextlib.suppress(ProcessLookupError, NameError):
            os.kill(child, signal.SIGKILL)


def spawn_cluster(path: Path, ignore_sigint: bool = False) -> tuple[subprocess.Popen, list[int]]:
    """Start `--cluster` and return once its node processes exist (named n0..n5, before the mesh forms). With
    `ignore_sigint` it starts as a shell script's background job does: SIGINT ignored."""
    proc = spawn([sys.executable, str(REPO / "launch.py"), "--cluster", str(path), "--json"],
                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None)
    deadline = time.monotonic() + 60
    kids: list[int] = []
    nodes: set[str] = set()
    while time.monotonic() < deadline and len(nodes) < 6 and proc.poll() is None:
        kids = children_of(proc.pid)  # the 6 nodes and the fork server (with its resource tracker)
        nodes = {name for name in map(process_name, kids) if re.fullmatch(r"n\d", name)}
        time.sleep(0.01)
    assert len(nodes) == 6, proc.communicate(timeout=60)
    return proc, kids


def process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.NoSuchProcess:
        return ""


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, ignored", [(signal.SIGINT, 130, False), (signal.SIGTERM, 130, False),
                                               (signal.SIGINT, 130, True)])
def test_interrupt_tears_everything_down(tmp_path: Path, sig: int, code: int, ignored: bool) -> None:
    proc, kids = spawn_cluster(cluster_yaml(tmp_path, 6), ignore_sigint=ignored)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err  # the signal lands long before 6 interpreters have started
    assert gone(kids), [p for p in kids if psutil.pid_exists(p)]


def test_an_interrupt_swallowed_during_a_fork_still_stops_the_run() -> None:
    """A SIGINT that lands while subprocess forks a node runs the handler inside logging's at-fork
    hook, which only prints the KeyboardInterrupt (seen once in four runs of the test above: the
    emulator then served its whole workload and exited 0). The next check of the wait loops raises it."""
    from meshllm import emulate

    cluster = EmulatedCluster.__new__(EmulatedCluster)
    cluster.procs = {}
    try:
        with contextlib.suppress(KeyboardInterrupt):  # what the at-fork hook does with it
            emulate.raise_interrupt(signal.SIGINT, None)
        with pytest.raises(KeyboardInterrupt):
            cluster._check_alive()
    finally:
        emulate.INTERRUPTED.clear()
    cluster._check_alive()  # no interrupt pending: nothing raised


@pytest.mark.slow
def test_nodes_die_with_a_killed_emulator(tmp_path: Path) -> None:
    proc, kids = spawn_cluster(cluster_yaml(tmp_path, 6))
    os.kill(proc.pid, signal.SIGKILL)  # no teardown code runs: PR_SET_PDEATHSIG must do it
    proc.communicate(timeout=60)
    assert gone(kids), [p for p in kids if psutil.pid_exists(p)]


def test_a_run_that_fails_or_is_interrupted_keeps_its_logs_but_not_its_secrets(tmp_path: Path) -> None:
    """The emulator's run directory holds every node's secret key and the API token: a run that
    ended by an error or Ctrl-C left them in /tmp (the logs are kept for a look); a clean end
    removes the whole directory."""
    from meshllm.emulate import EmulatedCluster

    cfg = parse_cluster(yaml.safe_load(cluster_yaml(tmp_path, 2, security={"curve": True, "api_token": True})
                                       .read_text()), "test")
    for stop in (RuntimeError("a failure"), KeyboardInterrupt()):
        with pytest.raises(type(stop)), EmulatedCluster(cfg) as em:
            assert any((em.workdir / "keys").iterdir()) and (em.workdir / "api_token").is_file()
            raise stop
        assert not (em.workdir / "keys").exists() and not (em.workdir / "api_token").exists()
        assert {p.name for p in em.workdir.glob("*.log")} == {"n0.log", "n1.log"}
        shutil.rmtree(em.workdir)
    with EmulatedCluster(cfg) as em:
        pass
    assert not em.workdir.exists()


@pytest.mark.slow
def test_a_second_interrupt_in_the_teardown_or_a_failed_start_still_deletes_the_secrets(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """A second Ctrl-C lands in close() (waiting out the nodes' SIGTERM grace): __exit__ stopped
    there, and every node's secret key and the API token stayed in /tmp. A start that fails
    (__enter__ raises: no __exit__ follows) left them too."""
    from meshllm.emulate import EmulatedCluster

    cfg = parse_cluster(yaml.safe_load(cluster_yaml(tmp_path, 2, security={"curve": True, "api_token": True})
                                       .read_text()), "test")
    close = EmulatedCluster.close

    def interrupted(self) -> None:
        close(self)  # the nodes are stopped and reaped; then the second Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(EmulatedCluster, "close", interrupted)
    with pytest.raises(KeyboardInterrupt), EmulatedCluster(cfg) as em:
        raise KeyboardInterrupt
    assert not (em.workdir / "keys").exists() and not (em.workdir / "api_token").exists()
    assert (em.workdir / "n0.log").is_file() and all(p.poll() is not None for p in em.procs.values())
    shutil.rmtree(em.workdir)
    monkeypatch.setattr(EmulatedCluster, "close", close)
    started = EmulatedCluster._start_node

    def fails_at_the_second(self, i: int, again: bool = False) -> None:
        if i == 1:
            raise RuntimeError("no second node")
        started(self, i, again)

    monkeypatch.setattr(EmulatedCluster, "_start_node", fails_at_the_second)
    em = EmulatedCluster(cfg)
    with pytest.raises(RuntimeError, match="no second node"), em:
        pass
    assert (em.workdir / "n0.log").is_file() and not (em.workdir / "keys").exists()
    assert not (em.workdir / "api_token").exists() and em.procs["n0"].poll() is not None
    shutil.rmtree(em.workdir)


def test_serve_says_where_its_api_token_is_and_names_the_last_gateway_to_die(tmp_path: Path) -> None:
    """`--serve` with `security: {api_token: true}` printed only its URL, and every request was a
    401 until one found the token's file; when the last gateway node died, the error named the
    first gateway (already dead), not the last one."""
    from tests.serving_util import Served, small_device, write_cluster

    dev = small_device("nuc-like", 8.0)
    path = write_cluster(tmp_path / "two-gw.yaml", [
        {"id": "g1", "device": dev, "zone": "fog", "roles": ["prefill", "decode", "gateway"]},
        {"id": "g2", "device": dev, "zone": "fog", "roles": ["prefill", "decode", "gateway"]}],
        security={"api_token": True})
    served = Served(path, tmp_path / "serve.log")
    try:
        m = re.search(r"the API wants `Authorization: Bearer TOKEN`; TOKEN is in (\S+) ", served.log.read_text())
        assert m, served.log.read_text()[-2000:]
        token = Path(m.group(1)).read_text().strip()
        assert token not in served.log.read_text()  # the file is named, the secret is not printed
        req = urllib.request.Request(served.url + "/v1/models", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        assert served.get("/v1/models")[0] == 401
        (other,) = re.findall(r"meshllm: another gateway on (http://\S+)", served.log.read_text())

        def pid(url: str, node: str) -> int:
            req = urllib.request.Request(url + "/v1/mesh", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())["nodes"][node]["load"]["pid"]

        os.killpg(pid(served.url, "g1"), signal.SIGKILL)
        assert wait_for(lambda: "node g1 was killed by SIGKILL" in served.log.read_text(), 30)
        os.killpg(pid(other, "g2"), signal.SIGKILL)
        served.proc.wait(timeout=60)
        assert served.proc.returncode == 1
        # what ended it, then the end of its log from a line's start (it began mid-word: "s a new one: ...")
        log = served.log.read_text()
        m = re.search(r"the last gateway node, g2, was killed by SIGKILL; its log ends: (.*)", log, re.S)
        assert m, log[-2000:]
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} meshllm", m.group(1)), m.group(1)[:300]
    finally:
        served.stop()


def test_node_processes_can_be_pinned_to_cores_round_robin(tmp_path: Path) -> None:
    """Benchmarks pin each emulated device to a core (bench/pipeline.py): every thread of node i,
    started later, stays on cpus[i % len(cpus)]."""
    from meshllm.emulate import EmulatedCluster

    cpus = sorted(os.sched_getaffinity(0))
    cfg = parse_cluster(yaml.safe_load(cluster_yaml(tmp_path, 3).read_text()), "test")
    with EmulatedCluster(cfg, cpus=cpus) as em:
        em.wait_formed()
        for i, (nid, proc) in enumerate(em.procs.items()):
            threads = psutil.Process(proc.pid).threads()
            assert len(threads) > 1
            for th in threads:
                assert os.sched_getaffinity(th.id) == {cpus[i % len(cpus)]}, (nid, th.id)


@pytest.mark.slow
def test_a_node_that_cannot_take_its_part_of_the_plan_is_planned_around_and_the_emulator_stops_at_once(
        tmp_path: Path, smollm2, smollm2_tokenizer) -> None:
    """A drafter whose draft could not be built (draft groups of 128 on smollm2's 576 columns; the
    cluster file's check, config.plan_inputs, is bypassed here, and the node file names the model by
    its path, whose shape a node reads only when it runs) logged a traceback and the emulator
    waited READY_TIMEOUT_S (300 s) for a mesh that never served. Now the node's status says why
    (`plan_error`) and waiting for the mesh stops at once with that reason; and the coordinator
    (the failing node itself here: "edge" is the lowest id) re-plans without it, so the mesh serves
    (a deployed one would have waited for ever), the plan naming why the node is unused."""
    from meshllm.emulate import READY_TIMEOUT_S, EmulatedCluster, http_json
    from meshllm.engine.sources import embedded_gguf_path
    from tests.serving_util import reference, same_up_to_tie

    doc = {"model": str(embedded_gguf_path("smollm2-135m")), "draft": {"quant": "w4a16", "group_size": 128},
           "speculation": {"mode": "async", "gamma": 2},
           "nodes": [{"id": "fog", "device": DEV, "zone": "fog"},
                     {"id": "edge", "device": DEV, "zone": "edge", "roles": ["drafter"]}],
           "links": [{"zones": ["edge", "fog"], "rtt_ms": 20, "bandwidth_mbps": 100}],
           "workload": {"prompts": ["Hello there"], "max_tokens": 3}}
    cfg = parse_cluster(doc, "test")
    with EmulatedCluster(cfg, tmp_path) as em:
        em.wait_formed()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"node edge could not take its part of plan v\d+: ValueError: "
                                               r"in_features 576 is not a multiple of group_size 128"):
            em.wait_serving()
        assert time.monotonic() - t0 < READY_TIMEOUT_S / 3
        url = f"http://{em.gateway}"

        def planned_around() -> dict | None:
            code, got = http_json(f"{url}/v1/plan", 2.0)
            why = got.get("plan", {}).get("unused_reasons", {}).get("edge", "") if code == 200 else ""
            return got if why.startswith("could not take its part of plan v") else None

        assert wait_for(lambda: planned_around() is not None and http_json(f"{url}/health", 2.0)[0] == 200, 60.0)
        plan = planned_around()["plan"]
        assert "in_features 576 is not a multiple of group_size 128" in plan["unused_reasons"]["edge"]
        assert "edge" in plan["unused"] and not plan["drafters"] and len(plan["replicas"]) == 1
        with pytest.raises(RuntimeError, match=r"node edge could not take its part of plan v\d+: .* the mesh serves "
                                               r"plan v\d+ without it"):
            em.wait_serving(30.0)  # an emulation serves the cluster of its file, or says why not
        model = http_json(f"{url}/v1/models", 2.0)[1]["data"][0]["id"]  # named by its path here
        body = json.dumps({"model": model, "prompt": "Hello there", "max_tokens": 6,
                           "temperature": 0}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", body, method="POST"),
                                    timeout=60) as r:
            got = json.loads(r.read())["choices"][0]["token_ids"]
        ok, why = same_up_to_tie(got, reference(smollm2, smollm2_tokenizer, "Hello there", 6))
        assert ok, why


def test_a_cluster_run_without_prompts_sends_synthetic_ones_of_the_workload_s_lengths(tmp_path: Path,
                                                                                      smollm2) -> None:
    """`input_tokens` shapes synthetic prompts (it was an exit 2: no prompts): token
    ids, seeded, of the workload's lengths, at most max_tokens out; greedy, the reference's tokens."""
    from meshllm.engine.generate import GenerationOptions, generate
    from meshllm.engine.tokenizer import load_tokenizer
    from meshllm.engine.weights import resolve_model
    from tests.serving_util import same_up_to_tie

    wl = {"max_tokens": 3, "requests": 2, "input_tokens": {"mean": 12, "dist": "fixed"},
          "output_tokens": {"mean": 8, "dist": "fixed"}}
    path = cluster_yaml(tmp_path, 2, workload=wl, weights_dtype="fp32")
    r = run_cli("--cluster", str(path), "--chat", "--json", timeout=60)
    assert r.returncode == 2 and "workload.prompts" in r.stderr and "chat" in r.stderr and r.stdout == ""
    r = run_cli("--cluster", str(path), "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)["results"]
    assert len(results) == 2 and results[0]["prompt"] != results[1]["prompt"]
    eos = load_tokenizer(resolve_model("smollm2-135m")).eos_ids
    for res in results:
        ids = res["prompt"]
        assert len(ids) == 12 and all(1000 <= i < smollm2.args.vocab_size for i in ids)
        ref = generate(smollm2, ids, GenerationOptions(3, 0.0), eos)
        ok, why = same_up_to_tie(res["token_ids"], {"token_ids": ref.token_ids, "margins": ref.margins})
        assert ok, why


@pytest.mark.parametrize("data, where", [
    ({"model": "m", "nodes": [{"id": "a", "device": DEV, "zone": "z", "colour": 1}]}, "nodes[0].colour"),
    ({"model": "m", "nodes": [{"id": "a", "zone": "z"}]}, "nodes[0].device"),
    ({"model": "m", "nodes": [{"id": "a", "device": "no-such-device", "zone": "z"}]}, "unknown device"),
    ({"model": "m", "nodes": [{"id": "a", "device": DEV, "zone": "z"}],
      "links": [{"zones": ["z", "mars"], "rtt_ms": 1, "bandwidth_mbps": 1}]}, "links[0].zones"),
])
def test_bad_cluster_yaml_exits_2_with_one_line(tmp_path: Path, data: dict, where: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    r = run_cli("--cluster", str(path), "--json", timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and where in lines[0], r.stderr


@pytest.mark.slow
def test_formation_timeout_is_a_runtime_error_without_orphans(tmp_path: Path) -> None:
    proc = spawn([sys.executable, str(REPO / "launch.py"), "--cluster", str(cluster_yaml(tmp_path, 6)),
                  "--json", "--timeout", "0.01"], cwd=REPO, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True)
    kids: list[int] = []
    while proc.poll() is None:  # collect the node pids while they live
        kids = sorted(set(kids) | set(children_of(proc.pid)))
        time.sleep(0.01)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and out == "" and "did not form" in err
    assert kids and gone(kids)


def test_the_readable_report_names_the_faults_and_what_clients_saw() -> None:
    """Without --json a fault run said nothing of its faults, resumes or the healing."""
    from meshllm.workload import format_report

    m = {"requests": 9, "failed": 0, "ttft_ms_mean": 1, "ttft_ms_p99": 2, "itl_ms_mean": 1, "itl_ms_p50": 1,
         "itl_ms_p99": 2, "output_tokens_per_s": 3, "queue_wait_ms_mean": 0, "acceptance_rate": None,
         "resumed_requests": 5, "recovery_gap_ms_max": 3720.5}
    faults = [{"kind": "kill", "node": "fog-2", "at_s": 2.02},
              {"kind": "partition", "zones": ["edge", "fog"], "at_s": 0.5, "until_s": 4.0, "healed_after_s": 0.93},
              {"kind": "partition", "zones": ["edge", "fog"], "at_s": 5.0, "until_s": 6.0, "healed_after_s": None}]
    lines = format_report({"results": [], "metrics": m, "faults": faults}).splitlines()
    assert any("kill -9 fog-2" in ln and "at 2.02 s" in ln for ln in lines)
    assert any("partition edge:fog" in ln and "0.5-4.0 s, every node in use again 0.93 s after" in ln for ln in lines)
    assert any("5.0-6.0 s, not healed" in ln for ln in lines)
    assert any(ln.startswith("resumed requests / recovery gap max") and ln.endswith("5 / 3720.5") for ln in lines)
    plain = format_report({"results": [], "metrics": m}).splitlines()
    assert not any("fault" in ln or "resumed" in ln for ln in plain)  # a run without faults: no such rows
    m["nodes"] = {"fog-3": {"roles": ["decode"], "layers": [0, 19], "rss_mb": 742.5},
                  "edge-1": {"roles": ["drafter"], "layers": None, "rss_mb": 524.3}}
    rows = format_report({"results": [], "metrics": m}).splitlines()  # half-open, as the plan and --status
    assert any(ln.startswith("node fog-3 decode layers [0, 19)") for ln in rows), rows
    assert any(ln.startswith("node edge-1 drafter layers -") for ln in rows), rows


def _node_told_its_server(wrong: bool) -> None:
    from meshllm.node_procs import die_with_emulator

    die_with_emulator(os.getppid() + wrong)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_node_forked_as_the_emulator_dies_does_not_outlive_it() -> None:
    """The fork server (or the emulator) gone between a node's fork and its prctl(PR_SET_PDEATHSIG)
    leaves that node no death signal to get (it is re-parented already): the node checks that its
    parent is still the fork server after the prctl and exits if not. Here the pid it is told is
    not its parent's."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    for wrong, code in ((True, 1), (False, 0)):
        proc = ctx.Process(target=_node_told_its_server, args=(wrong,))
        proc.start()
        proc.join(30)
        assert proc.exitcode == code, wrong


def test_a_node_stopped_before_it_runs_a_line_still_has_its_log(tmp_path: Path) -> None:
    """The log was made by the node process itself: a run stopped right after a node's start (an
    error, a Ctrl-C) could kill that process before it got there, and the run directory it keeps
    for a look had no log for that node. start_node makes it; a restart appends to it."""
    from meshllm.node_procs import NodeProcess, signals_held, start_node

    log_path = tmp_path / "n0.log"
    for append in (False, True):
        with signals_held():
            proc = start_node("n0", ["--help"], log_path, tmp_path, dict(os.environ), None, append=append)
        assert log_path.is_file()
        os.kill(proc.pid, signal.SIGKILL)
        assert isinstance(proc, NodeProcess) and proc.wait(timeout=30) != 0
        log_path.write_text("earlier life\n")
    with signals_held():
        proc = start_node("n0", ["--help"], log_path, tmp_path, dict(os.environ), None, append=True)
    proc.wait(timeout=60)
    assert log_path.read_text().startswith("earlier life\n")


def test_no_fault_fires_after_the_run_is_cut_short():
    """Ctrl-C during the workload: the faults thread went on, and a `--restart` started a node
    0.36 s into the teardown, a `--pause` stopped one 0.3 s after the Ctrl-C. halt() ends it:
    nothing due later runs. Real processes stand for the nodes."""
    from types import SimpleNamespace

    from meshllm.faults import Fault, FaultInjector

    procs = {n: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
             for n in ("a", "b")}
    try:
        cluster = SimpleNamespace(procs=procs, dead=set)
        for verb in ("pause", "resume", "kill"):
            setattr(cluster, verb, lambda nid, verb=verb: getattr(EmulatedCluster, verb)(cluster, nid))
        inj = FaultInjector(cluster, [Fault("pause", 0.4, node="a", until_s=5.0), Fault("kill", 0.5, node="b")])
        inj.start()
        inj.halt()
        time.sleep(1.0)
        assert [p.poll() for p in procs.values()] == [None, None], "a fault ran after halt()"
        assert psutil.Process(procs["a"].pid).status() != psutil.STATUS_STOPPED and inj.done == []
    finally:
        for p in procs.values():
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_a_node_still_stopped_when_the_workload_ends_is_continued():
    """`--pause NODE@S1-S2` whose end comes after the workload's: the injector continues the
    node (SIGCONT) when it stops, or teardown would wait on a stopped process group. A real
    process stands for the node: EmulatedCluster.pause/resume signal its group."""
    from types import SimpleNamespace

    from meshllm.faults import Fault, FaultInjector

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        cluster = SimpleNamespace(procs={"n": proc})
        cluster.pause = lambda nid: EmulatedCluster.pause(cluster, nid)
        cluster.resume = lambda nid: EmulatedCluster.resume(cluster, nid)
        inj = FaultInjector(cluster, [Fault("pause", 0.0, node="n", until_s=600.0)])
        inj.start()
        assert wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 10.0)
        inj.stop()
        assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED
        # until_s: when it was continued (the workload's end here), not the schedule's 600 s
        assert [(d["kind"], d["node"], d["at_s"] < 1.0, d["until_s"] < 60) for d in inj.done] == \
            [("pause", "n", True, True)]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
