"""The fault injector's schedule (faults.py): a partition told to every node at once, a node the
injector stopped told the rest of it when continued, the report's times measured; faults the
workload ended before listed as not run; overlapping pauses of one node refused. Stand-in nodes
answer the partition's FAULT on real sockets on 127.0.0.1, as a node's control socket does."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from meshllm.config import parse_cluster
from meshllm.errors import InputError
from meshllm.faults import Fault, FaultInjector, parse_faults
from meshllm.mesh.protocol import MsgType, decode, encode, make
from meshllm.yaml_fields import read_yaml
from tests.conftest import REPO, run_cli

CLUSTER = REPO / "clusters" / "failure.yaml"


class StandIn:
    """A node's control socket (a ROUTER) that answers FAULT with PONG and records when it took
    each; while `stopped` it reads nothing, as a SIGSTOPped process (messages wait in its queue)."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.linger = 0
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stopped, self.got, self._quit = False, [], threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._quit.is_set():
            if self.stopped or not self.sock.poll(20):
                time.sleep(0.01)
                continue
            ident, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            self.got.append((time.monotonic(), msg.type, msg["seconds"]))
            self.sock.send_multipart([ident, *encode(make(MsgType.PONG))])

    def close(self) -> None:
        self._quit.set()
        self._thread.join(5)
        self.sock.close()


class StandInCluster:
    """What FaultInjector uses of EmulatedCluster: n3 first (told first, the old code waited on it)."""

    def __init__(self) -> None:
        self.nodes = {n: StandIn() for n in ("n3", "n1", "n2")}
        self.addresses = {n: f"127.0.0.1:{s.port}" for n, s in self.nodes.items()}
        self.keys, self.killed = None, {}

    def target(self, nid: str) -> str:
        return f"{nid}@{self.addresses[nid]}"

    def dead(self) -> set[str]:
        return set(self.killed)

    def kill(self, nid: str) -> None:
        self.killed[nid] = time.monotonic()

    def pause(self, nid: str) -> None:
        self.nodes[nid].stopped = True

    def resume(self, nid: str) -> None:
        self.nodes[nid].stopped = False

    def close(self) -> None:
        for s in self.nodes.values():
            s.close()


@pytest.fixture
def standins():
    c = StandInCluster()
    yield c
    c.close()


def run_injector(cluster: StandInCluster, faults: list[Fault], for_s: float) -> tuple[FaultInjector, float]:
    inj = FaultInjector(cluster, faults)
    t0 = time.monotonic()
    inj.start()
    time.sleep(for_s)
    inj.stop()
    return inj, t0


def test_a_partition_while_a_node_is_stopped_delays_nothing_and_the_report_says_so(standins):
    """`--pause fog-3@0.5-8 --partition edge:fog@1-2 --kill fog-2@1.5`: the partition went to one
    node at a time, each with a 3 s timeout, and the stopped node cannot answer: the nodes after
    it were cut off 3 s late, the kill ran at 4.05 s, and the report still said the partition
    ran 1-2 s and the pause until 8 s (scheduled, not measured)."""
    faults = [Fault("pause", 0.0, node="n3", until_s=30.0), Fault("partition", 0.3, zones=("a", "b"), until_s=1.3),
              Fault("kill", 0.5, node="n2")]
    inj, t0 = run_injector(standins, faults, 1.5)
    for n in ("n1", "n2"):  # told on time, each once
        assert [(round(t - t0, 1) <= 0.6, seconds) for t, _, seconds in standins.nodes[n].got] == [(True, 1.0)]
    assert standins.nodes["n3"].got == []  # stopped throughout the partition: never told
    assert standins.killed and standins.killed["n2"] - t0 < 0.9  # not held by the partition
    pause, part, kill = inj.done
    assert kill["kind"] == "kill" and kill["at_s"] < 0.9
    assert part["not_told"] == {"n3": "stopped (--pause) until the partition's end"}, part
    assert 1.4 <= pause["until_s"] < 2.2, pause  # continued when the workload ended, not at 30 s
    assert inj.not_run == []


def test_a_node_continued_during_a_partition_is_told_the_rest_of_it(standins):
    faults = [Fault("pause", 0.0, node="n3", until_s=0.6), Fault("partition", 0.2, zones=("a", "b"), until_s=1.4)]
    inj, t0 = run_injector(standins, faults, 1.0)
    [(t, mtype, seconds)] = standins.nodes["n3"].got
    assert mtype is MsgType.FAULT and 0.55 <= t - t0 < 0.9 and 0.6 < seconds < 0.85, (t - t0, seconds)
    pause, part = inj.done
    assert 0.55 <= pause["until_s"] < 0.8, pause
    assert "not_told" not in part and 0.55 <= part["told_late"]["n3"] < 0.9, part
    assert (part["at_s"], part["until_s"]) < (0.5, 1.7)


def test_faults_the_workload_ended_before_are_listed_as_not_run(standins, caplog):
    """`--kill fog-2@100 --pause fog-3@50-60` on a shorter workload: rc 0 and "faults": [] said
    nothing of the drill that did not happen."""
    from meshllm.workload import format_report

    faults = [Fault("kill", 0.0, node="n1"), Fault("pause", 50.0, node="n3", until_s=60.0),
              Fault("kill", 100.0, node="n2")]
    with caplog.at_level(logging.WARNING, logger="meshllm.emulate"):
        inj, _ = run_injector(standins, faults, 0.3)
    assert [d["node"] for d in inj.done] == ["n1"]
    assert [(d["kind"], d["node"], d["at_s"], d.get("until_s")) for d in inj.not_run] == \
        [("pause", "n3", 50.0, 60.0), ("kill", "n2", 100.0, None)]
    assert all(d["reason"].startswith("the workload ended at 0.") for d in inj.not_run), inj.not_run
    assert any("2 fault(s) not run" in r.message and "--kill n2@100" in r.message for r in caplog.records)
    m = {"requests": 1, "failed": 0, "ttft_ms_mean": 1, "ttft_ms_p99": 1, "itl_ms_mean": 1, "itl_ms_p50": 1,
         "itl_ms_p99": 1, "output_tokens_per_s": 1, "queue_wait_ms_mean": 0}
    text = format_report({"results": [], "metrics": m, "faults": inj.done, "faults_not_run": inj.not_run})
    assert "fault not run: kill n2" in text and "due at 100.0 s" in text, text


def failure_cfg():
    return parse_cluster(read_yaml(CLUSTER), str(CLUSTER))


@pytest.mark.parametrize("spans", [("1-3", "2-4"), ("1-3", "3-4"), ("2-4", "1-5")])
def test_overlapping_pauses_of_one_node_are_refused(spans):
    """`--pause fog-2@1-3 --pause fog-2@2-4` was taken: the node was continued at 3 s, nothing
    happened at 4 s, and the report said it was stopped until 4 s."""
    with pytest.raises(InputError, match=r"--pause fog-2@\S+ and --pause fog-2@\S+ overlap"):
        parse_faults(failure_cfg(), [], [], ["fog-1", "fog-4"], pauses=[f"fog-2@{s}" for s in spans])


@pytest.mark.parametrize("kills, restarts, pauses, why", [
    (["fog-2@1"], [], ["fog-2@2-3"], r"--pause fog-2@2-3 comes after --kill fog-2@1, which leaves the node dead"),
    (["fog-2@0.5", "fog-2@1.5"], [], [], r"--kill fog-2@1.5 comes after --kill fog-2@0.5"),
    ([], ["fog-3@2"], ["fog-3@0.5-6"], r"--restart fog-3@2 falls within --pause fog-3@0.5-6"),
    (["fog-3@3"], [], ["fog-3@0.5-6"], r"--kill fog-3@3 falls within --pause fog-3@0.5-6")])
def test_faults_that_would_find_their_node_dead_or_stopped_are_refused(kills, restarts, pauses, why):
    """`--kill fog-2@1 --pause fog-2@2-3` was taken and the report listed the pause of a dead node
    with its times; `--pause fog-3@0.5-6 --restart fog-3@2` listed a pause until 6 s of a node
    whose new process ran from 2 s."""
    with pytest.raises(InputError, match=why):
        parse_faults(failure_cfg(), kills, [], ["fog-1", "fog-4"], restarts=restarts, pauses=pauses)


def test_a_node_killed_then_restarted_or_paused_and_then_killed_is_taken():
    faults = parse_faults(failure_cfg(), ["fog-2@1", "fog-3@4"], [], ["fog-1", "fog-4"],
                          restarts=["fog-2@3"], pauses=["fog-2@4-5", "fog-3@1-3"])
    assert [(f.kind, f.node, f.at_s) for f in faults] == [("kill", "fog-2", 1), ("pause", "fog-3", 1),
                                                          ("restart", "fog-2", 3), ("kill", "fog-3", 4),
                                                          ("pause", "fog-2", 4)]


def test_pauses_of_one_node_apart_and_of_two_nodes_at_once_are_taken():
    faults = parse_faults(failure_cfg(), [], [], ["fog-1", "fog-4"],
                          pauses=["fog-2@3.5-4", "fog-2@1-3", "fog-3@1-3"])
    assert [(f.node, f.at_s, f.until_s) for f in faults] == [("fog-2", 1, 3), ("fog-3", 1, 3), ("fog-2", 3.5, 4)]


@pytest.mark.parametrize("pair", ["edge:fog", "fog:edge"])
def test_overlapping_partitions_of_one_zone_pair_are_refused(pair):
    """`--partition edge:fog@1-3 --partition edge:fog@2-6` was taken: the pair healed at 3 s, and
    the report said the second partition lasted until 6 s."""
    with pytest.raises(InputError, match=r"--partition edge:fog@1-3 and --partition \S+@2-6 overlap.*edge:fog@1-6"):
        parse_faults(failure_cfg(), [], ["edge:fog@1-3", f"{pair}@2-6"], ["fog-1", "fog-4"])
    faults = parse_faults(failure_cfg(), [], ["edge:fog@1-3", f"{pair}@3.5-6"], ["fog-1", "fog-4"])
    assert [(f.at_s, f.until_s) for f in faults] == [(1, 3), (3.5, 6)]


def test_overlapping_pauses_exit_2_with_one_line_before_anything_starts():
    r = run_cli("--cluster", str(CLUSTER), "--pause", "fog-2@1-3", "--pause", "fog-2@2-4", timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "overlap" in r.stderr and "fog-2@1-4" in r.stderr, r.stderr


def test_the_workload_ending_during_a_long_partition_still_waits_for_its_heal(standins, monkeypatch):
    """stop() joined the faults thread for the heal's timeout + 13 s only: a partition still in
    force 13 s past the workload's end left the thread running (it reported "did not heal" after
    the report was out) and the entry without `healed_after_s`. Now the join counts the rest of
    the partition too."""
    import meshllm.faults as faults

    monkeypatch.setattr(faults, "SEND_TIMEOUT_S", 0.2)  # the old join: 0.2 + 0.2 + 10 s
    inj = FaultInjector(standins, [Fault("partition", 0.1, zones=("a", "b"), until_s=11.5)],
                        live_plan=lambda: {}, heal_timeout_s=0.2)
    inj.start()
    time.sleep(0.3)
    inj.stop()
    assert not inj._thread.is_alive()
    [part] = inj.done
    assert "healed_after_s" in part, part
