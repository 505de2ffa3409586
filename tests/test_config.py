"""Cluster and node file validation: every error names the file, the field and the problem."""

from __future__ import annotations

import pytest
import yaml

from meshllm.config import load_cluster, parse_cluster
from meshllm.errors import ConfigError
from meshllm.node_config import load_node
from tests.conftest import run_cli

DEV = {"memory_gb": 8, "compute_tflops": 1, "memory_bandwidth_gbps": 50, "network_mbps": 1000}
BASE = {
    "model": "smollm2-135m",
    "nodes": [{"id": "a", "device": DEV, "zone": "fog"}, {"id": "b", "device": DEV, "zone": "edge"}],
    "links": [{"zones": ["edge", "fog"], "rtt_ms": 80, "bandwidth_mbps": 50}],
}


def _with(**changes):
    d = yaml.safe_load(yaml.safe_dump(BASE))
    for path, value in changes.items():
        cur = d
        keys = path.split("__")
        for k in keys[:-1]:
            cur = cur[int(k)] if isinstance(cur, list) else cur[k]
        last = keys[-1]
        if value is KeyError:
            del cur[last]
        elif isinstance(cur, list):
            cur[int(last)] = value
        else:
            cur[last] = value
    return d


def test_valid_cluster_defaults():
    c = parse_cluster(_with(), "c.yaml")
    assert c.draft.quant == "w4a16" and c.draft.group_size == 64
    assert c.speculation.mode == "async" and c.workload.max_tokens == 48
    assert c.link("fog", "edge").rtt_ms == 80 and c.link("fog", "fog") is None


@pytest.mark.parametrize("changes,field,problem", [
    ({"colour": "red"}, "colour", "unknown key"),
    ({"model": KeyError}, "model", "missing required field"),
    ({"nodes__1__id": "a"}, "nodes[1].id", "duplicate"),
    ({"nodes__0__device": "toaster-9000"}, "device", "unknown device"),
    ({"nodes__0__device": {"memory_gb": 8}}, "device.compute_tflops", "missing"),
    ({"nodes__0__device": {**DEV, "memory_gb": -1}}, "device.memory_gb", "positive"),
    ({"nodes__0__roles": ["cook"]}, "nodes[0].roles[0]", "must be one of"),
    ({"links__0__zones": ["edge", "moon"]}, "links[0].zones", "moon"),
    ({"links__0__bandwidth_mbps": 0}, "links[0].bandwidth_mbps", "in [0.001, 1e+07]"),
    # past what one device or link may have: 1e300 overflowed or divided by zero in the planner (exit 1)
    ({"nodes__0__device": {**DEV, "memory_gb": 1.0e300}}, "device.memory_gb", "in [0.001, 100000] for one device"),
    ({"nodes__0__device": {**DEV, "compute_tflops": 1.0e300}}, "device.compute_tflops", "in [1e-06, 1e+06]"),
    ({"links__0__bandwidth_mbps": 1.0e-320}, "links[0].bandwidth_mbps", "in [0.001, 1e+07]"),
    ({"links__0__rtt_ms": 1.0e100}, "links[0].rtt_ms", "in [0, 1e+06]"),
    # a mean of 0.001 drew 0-token requests (--simulate: ZeroDivisionError), 0.5 predicted negative waits
    ({"workload": {"input_tokens": {"mean": 0.001}}}, "workload.input_tokens.mean", ">= 1"),
    ({"workload": {"output_tokens": {"mean": 0.5, "dist": "uniform"}}}, "workload.output_tokens.mean", ">= 1"),
    ({"workload": {"arrival_rate_per_s": 1.0e-300}}, "workload.arrival_rate_per_s", "0 (none) or at least 1e-09"),
    ({"workload": {"arrival_rate_per_s": 1.0e+300}}, "workload.arrival_rate_per_s", "in [0, 1e+06]"),
    ({"nodes__0__roles": ["drafter", "drafter"]}, "nodes[0].roles", "names 'drafter' twice"),
    ({"draft": {"quant": "w3a16"}}, "draft.quant", "must be one of"),
    ({"draft": {"group_size": 48}}, "draft.group_size", "must be one of 32, 64, 128, 256"),
    ({"draft": {"group_size": 96}}, "draft.group_size", "must be one of 32, 64, 128, 256"),  # torch's int4 kernel
    ({"speculation": {"mode": "eager"}}, "speculation.mode", "must be one of"),
    ({"workload": {"max_tokens": 0}}, "workload.max_tokens", "in [1, 2147483648]"),
    # 10**12 was taken: --simulate ran a trace that long until killed, saying nothing
    ({"workload": {"requests": 10 ** 12}}, "workload.requests", "in [0, 100000]"),
    ({"workload": {"input_tokens": {"mean": 5, "dist": "zipf"}}}, "workload.input_tokens.dist", "zipf"),
    ({"nodes": []}, "nodes", "non-empty"),
    # a node id names the node's file in an emulation (x/y crashed --cluster, exit 1), its mDNS
    # service, an authorized_keys line and ID@HOST:PORT seeds
    ({"nodes__0__id": "x/y"}, "nodes[0].id", "letters, digits"),
    ({"nodes__0__id": "a b"}, "nodes[0].id", "letters, digits"),
    ({"nodes__0__id": "n@1"}, "nodes[0].id", "letters, digits"),
    ({"nodes__0__id": "-a"}, "nodes[0].id", "letters, digits"),
    ({"nodes__0__id": "a" * 64}, "nodes[0].id", "letters, digits"),
    # the planner took the last of two links for one pair of zones, silently
    ({"links": [{"zones": ["edge", "fog"], "rtt_ms": 80, "bandwidth_mbps": 50},
                {"zones": ["fog", "edge"], "rtt_ms": 5, "bandwidth_mbps": 500}]}, "links[1].zones", "links[0]"),
    # the API refuses more than 2 (every request of the run was a 400, after the mesh started)
    ({"workload": {"temperature": 5}}, "workload.temperature", "in [0, 2]"),
    ({"nodes__0__device": "../clusters/demo"}, "nodes[0]: device", "unknown device '../clusters/demo'"),
    # YAML 1.1 reads 1e30 (no dot) as text: the message said only "got '1e30'"; then it said
    # "write 1.0e30", which YAML 1.1 reads as text too (it wants a signed exponent: 1.0e+30)
    ({"nodes__0__device": {**DEV, "memory_bandwidth_gbps": "1e30"}}, "device.memory_bandwidth_gbps",
     "got '1e30' (YAML 1.1 reads a number with an exponent as text unless it has a dot and a signed "
     "exponent: write 1.0e+30)"),
    ({"workload": {"arrival_rate_per_s": "2e3"}}, "workload.arrival_rate_per_s", "write 2.0e+3)"),
    ({"workload": {"arrival_rate_per_s": "1.0e6"}}, "workload.arrival_rate_per_s", "write 1.0e+6)"),
    ({"workload": {"arrival_rate_per_s": "20"}}, "workload.arrival_rate_per_s", "write 20 without quotes"),
    # each field's own check, which another field's failing did not pin
    ({"nodes__0__roles": []}, "nodes[0].roles", "must be a non-empty list"),
    ({"security": {"curve": "yes"}}, "security.curve", "must be true or false"),
    ({"links__0__zones": ["edge", "fog", "fog"]}, "links[0].zones", "must be a list of two zone names"),
    ({"links__0__zones": ["", "fog"]}, "links[0].zones", "zone names are non-empty strings"),
    ({"speculation": {"adaptive": "yes"}}, "speculation.adaptive", "must be true or false"),
    ({"speculation": {"max_verify_batch": 2.5}}, "speculation.max_verify_batch", "must be an integer"),
    ({"speculation": {"gamma": 17}}, "speculation.gamma", "must be at most 16"),
    ({"speculation": {"gamma": 0}}, "speculation.gamma", "must be an integer >= 1"),
    ({"workload": {"prompts": ["hi", 3]}}, "workload.prompts", "must be a list of strings"),
    ({"workload": {"requests": True}}, "workload.requests", "must be an integer"),
])
def test_cluster_errors_name_field(changes, field, problem):
    with pytest.raises(ConfigError) as e:
        parse_cluster(_with(**changes), "c.yaml")
    msg = str(e.value)
    assert msg.startswith("c.yaml") and field in msg and problem in msg, msg


def test_the_yaml_number_hint_is_only_for_an_exponent_without_a_dot():
    """A quoted "4" got the hint about YAML reading 1e30 as text, which is not its cause."""
    from meshllm.errors import number_hint

    assert "write 1.0e+30" in number_hint("1e30") and "write 2.0e-3" in number_hint("2E-3")
    assert "write 4 without quotes" in number_hint("4") and "1e30" not in number_hint("4")
    assert number_hint("inf") == number_hint("four") == ""


def test_a_draft_group_size_the_model_does_not_split_into_is_a_config_error():
    """draft.group_size 128 on smollm2-135m (dim 576): every drafter failed to build the draft
    (ValueError in its log) and `--cluster` waited 300 s for a mesh that never served."""
    from meshllm.config import plan_inputs

    with pytest.raises(ConfigError, match=r"c.yaml: draft.group_size: 128 does not divide smollm2-135m's dim 576 "
                                          r"and FFN size 1536 .*it may be 32, 64"):
        plan_inputs(parse_cluster(_with(draft={"quant": "w4a16", "group_size": 128}), "c.yaml"))
    assert plan_inputs(parse_cluster(_with(draft={"quant": "w8a16", "group_size": 128}), "c.yaml"))  # no groups
    assert plan_inputs(parse_cluster(_with(draft={"quant": "w4a16", "group_size": 128},
                                           speculation={"mode": "off"}), "c.yaml"))  # no draft built


def test_a_workload_whose_mean_request_exceeds_the_context_is_a_config_error():
    """input_tokens mean 100000 on smollm2-135m (context 8192) was planned and simulated (capacity
    0.0008 req/s, TTFT 37 min) for requests the mesh would refuse with context_length_exceeded."""
    from meshllm.config import plan_inputs

    with pytest.raises(ConfigError, match=r"c.yaml: workload.input_tokens: mean 100000 \+ output_tokens mean 128 "
                                          r"exceed smollm2-135m's context of 8192 tokens"):
        plan_inputs(parse_cluster(_with(workload={"input_tokens": {"mean": 100000}}), "c.yaml"))
    assert plan_inputs(parse_cluster(_with(workload={"input_tokens": {"mean": 8000}, "output_tokens": {"mean": 192}}),
                                     "c.yaml"))
    # the default lengths are the planner's assumption, not the file's word: a test model's context
    # (tiny: 256) is shorter, and its nodes must still start
    assert plan_inputs(parse_cluster(_with(model="tiny"), "c.yaml"))
    with pytest.raises(ConfigError, match="exceed tiny's context of 256"):
        plan_inputs(parse_cluster(_with(model="tiny", workload={"output_tokens": {"mean": 300}}), "c.yaml"))


def test_ids_links_and_temperatures_in_range_are_taken():
    c = parse_cluster(_with(nodes__0__id="fog-1.a_B", workload={"temperature": 2},
                            links=[{"zones": ["edge", "fog"], "rtt_ms": 80, "bandwidth_mbps": 50},
                                   {"zones": ["fog", "fog"], "rtt_ms": 1, "bandwidth_mbps": 1000}]), "c.yaml")
    assert c.nodes[0].id == "fog-1.a_B" and c.workload.temperature == 2 and len(c.links) == 2


def test_a_key_given_twice_is_a_config_error(tmp_path):
    """YAML keeps the last of two equal keys: a second `nodes:` list silently dropped the first
    list's nodes from the plan (not even in `unused`), a second `model:` replaced the first."""
    p = tmp_path / "c.yaml"
    p.write_text("model: smollm2-135m\nnodes:\n  - {id: a, device: raspberry-pi-5-8gb, zone: fog}\n"
                 "nodes:\n  - {id: c, device: raspberry-pi-5-8gb, zone: fog}\n")
    with pytest.raises(ConfigError, match=r"c.yaml: line 4: invalid YAML: duplicate key 'nodes' \(first on line 2\)"):
        load_cluster(p)
    p.write_text("model: smollm2-135m\nnodes:\n  - {id: a, device: raspberry-pi-5-8gb, zone: fog, zone: edge}\n")
    with pytest.raises(ConfigError, match="duplicate key 'zone'"):
        load_cluster(p)
    p.write_text("model: smollm2-135m\nnodes:\n  - {id: a, device: raspberry-pi-5-8gb, zone: fog}\n"
                 "  - {id: b, device: raspberry-pi-5-8gb, zone: fog}\n")  # the same key in two mappings
    assert [n.id for n in load_cluster(p).nodes] == ["a", "b"]
    p.write_text("model: smollm2-135m\nnodes:\n  - &pi {id: a, device: raspberry-pi-5-8gb, zone: fog}\n"
                 "  - {<<: *pi, id: b, zone: edge}\n")  # a merge's keys may be overridden
    assert [(n.id, n.zone) for n in load_cluster(p).nodes] == [("a", "fog"), ("b", "edge")]
    n = tmp_path / "n.yaml"
    n.write_text("id: a\ndevice: raspberry-pi-5-8gb\nlisten: 127.0.0.1:7700\nlisten: 127.0.0.1:7800\n")
    with pytest.raises(ConfigError, match="n.yaml: line 4: invalid YAML: duplicate key 'listen'"):
        load_node(n)


def test_a_model_path_that_is_no_model_is_a_config_error_naming_the_file(tmp_path):
    """A node file whose model was /etc/passwd started a node whose coordinator logged "not a GGUF
    file" every plan and never served (not an exit 2); a cluster file's said no file or field."""
    from meshllm.config import plan_inputs

    for model, problem in [("/etc/passwd", "/etc/passwd: not a GGUF file"),
                           (str(tmp_path), "no config.json"),
                           (str(tmp_path / "none.gguf"), f"'{tmp_path / 'none.gguf'}': no such file")]:
        with pytest.raises(ConfigError, match=f"^c.yaml: model: .*{problem}"):
            plan_inputs(parse_cluster(_with(model=model), "c.yaml"))
    n = tmp_path / "n.yaml"
    for model, fetch in [("/etc/passwd", True), ("/etc/passwd", False), (str(tmp_path), True)]:
        n.write_text(yaml.safe_dump({"id": "a", "device": DEV, "listen": "127.0.0.1:7700", "model": model,
                                     "fetch_weights": fetch}))
        with pytest.raises(ConfigError, match=f"n.yaml: model: {model}: not"):
            load_node(n)
    n.write_text(yaml.safe_dump({"id": "a", "device": DEV, "listen": "127.0.0.1:7700",
                                 "model": str(tmp_path / "later.gguf")}))  # fetched from a peer
    assert load_node(n).model.endswith("later.gguf")


def test_bare_off_means_speculation_off(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(_with()) + "speculation: {mode: off}\n")
    assert load_cluster(p).speculation.mode == "off"


def test_yaml_syntax_error_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+: invalid YAML"):
        load_cluster(p)
    with pytest.raises(ConfigError, match="no such file"):
        load_cluster(tmp_path / "none.yaml")
    p.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_cluster(p)


def test_a_path_that_is_no_yaml_file_is_a_config_error(tmp_path):
    """A folder was "no such file", a binary file a runtime error (UnicodeDecodeError, exit 1) and
    /dev/zero was read for ever; a broken profile in devices/ was a YAML traceback."""
    from meshllm.device import load_device

    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        load_cluster(tmp_path)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_cluster("/dev/zero")
    binary = tmp_path / "model.gguf"
    binary.write_bytes(b"GGUF\x03\x00\x00\x00\xd0\xff" * 8)
    with pytest.raises(ConfigError, match=r"not a text file \(UTF-8\)"):
        load_cluster(binary)
    (tmp_path / "broken.yaml").write_text("memory_gb: [8\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: line \d+: invalid YAML"):
        load_device("broken", "n.yaml", devices_dir=tmp_path)


def test_a_falsy_section_is_refused_and_a_null_one_is_absent(tmp_path):
    """`speculation: off` (false in YAML 1.1) was taken as no section, so drafting stayed on; `links: 0`,
    `draft: false`, `workload: ''` or `seeds: 0` passed the same way. Only null (a bare `key:`) is absent."""
    for key, bad, msg in [("speculation", False, r"speculation: expected a mapping, got bool \(speculation: "
                                                 r"\{mode: off\} turns it off\)"),
                          ("draft", False, "draft: expected a mapping, got bool"),
                          ("workload", "", "workload: expected a mapping, got str"),
                          ("security", [], "security: expected a mapping, got list"),
                          ("links", 0, "links: must be a list"), ("links", 5, "links: must be a list")]:
        with pytest.raises(ConfigError, match=msg):
            parse_cluster(_with(**{key: bad}), "c.yaml")
    assert parse_cluster(_with(links=None, draft=None, speculation=None), "c.yaml").links == ()
    with pytest.raises(ConfigError, match="workload.prompts: must be a list of strings"):
        parse_cluster(_with(workload={"prompts": 0}), "c.yaml")
    p = tmp_path / "n.yaml"
    for bad, field in [({"seeds": 0}, "seeds"), ({"links": False}, "links"), ({"expect_nodes": ""}, "expect_nodes"),
                       ({"speculation": False}, "speculation")]:
        p.write_text(yaml.safe_dump({"id": "fog-1", "device": DEV, "listen": "127.0.0.1:7700", **bad}))
        with pytest.raises(ConfigError, match=f"n.yaml: {field}: "):
            load_node(p)


def test_zone_names_are_names_like_node_ids(tmp_path):
    """A link naming a zone {} was a TypeError (unhashable), a node's zone null became "None"; a
    zone with a newline (it is printed in logs and travels in every message header) was taken."""
    with pytest.raises(ConfigError, match=r"links\[0\].zones: zone names are non-empty strings"):
        parse_cluster(_with(links__0__zones=[{"a": 1}, "fog"]), "c.yaml")
    rule = "must be 1 to 63 letters, digits, '_', '-' or '.'"
    for bad in (None, "", 3, ["fog"], "fog\nplanner: forged", "-fog", "x" * 64, "fog zone"):
        with pytest.raises(ConfigError, match=rf"nodes\[0\].zone: {rule}"):
            parse_cluster(_with(nodes__0__zone=bad), "c.yaml")
    p = tmp_path / "n.yaml"
    for bad in (None, "edge\r"):
        p.write_text(yaml.safe_dump({"id": "fog-1", "device": DEV, "listen": "127.0.0.1:7700", "zone": bad}))
        with pytest.raises(ConfigError, match=f"n.yaml: zone: {rule}"):
            load_node(p)
    ok = parse_cluster(_with(nodes__0__zone="eu-west.1_b", links__0__zones=["edge", "eu-west.1_b"]), "c.yaml")
    assert ok.nodes[0].zone == "eu-west.1_b"


def test_nan_and_infinity_are_refused_where_a_number_is_read():
    """YAML's .nan passed `v < lo` (every comparison with NaN is false) and .inf every bound: a
    device of .nan GB or a link of .inf Mb/s reached the planner."""
    for changes, field in [({"links__0__rtt_ms": float("nan")}, r"links\[0\].rtt_ms"),
                           ({"links__0__bandwidth_mbps": float("inf")}, r"links\[0\].bandwidth_mbps"),
                           ({"nodes__0__device__memory_gb": float("nan")}, "device.memory_gb"),
                           ({"nodes__1__device__network_mbps": float("inf")}, "device.network_mbps"),
                           ({"time_scale": float("inf")}, "time_scale")]:
        with pytest.raises(ConfigError, match=field):
            parse_cluster(_with(**changes), "c.yaml")


def test_time_scale_is_bounded():
    """`time_scale: 500000` passed and every request then failed with an HTTP 500 (a socket timeout
    of 5 s x K overflowed); with links the mesh never formed within the emulator's 60 s."""
    for k in (500000, 100.5, 0.5):
        with pytest.raises(ConfigError, match=r"time_scale: .*\[1, 100\]"):
            parse_cluster(_with(time_scale=k), "c.yaml")
    assert parse_cluster(_with(time_scale=100), "c.yaml").time_scale == 100.0


def test_node_file(tmp_path):
    p = tmp_path / "n.yaml"
    p.write_text(yaml.safe_dump({"id": "fog-1", "device": DEV, "listen": "0.0.0.0:7700",
                                 "advertise": "127.0.0.1:7700", "seeds": ["127.0.0.1:7800"], "mdns": False}))
    n = load_node(p)
    assert n.advertise_address == "127.0.0.1:7700" and n.seeds == ("127.0.0.1:7800",)
    p.write_text(yaml.safe_dump({"id": "fog-1", "device": DEV, "listen": "127.0.0.1:7700",
                                 "gateway": {"listen": "127.0.0.1:7702"}}))
    assert load_node(p).gateway == "127.0.0.1:7702"
    p.write_text(yaml.safe_dump({"id": "fog-1", "device": DEV, "listen": "127.0.0.1:7700",
                                 "workload": {"arrival_rate_per_s": 2, "requests": 40, "input_tokens": {"mean": 64},
                                              "output_tokens": {"mean": 16}}}))
    wl = load_node(p).workload
    assert (wl.arrival_rate_per_s, wl.requests, wl.input_tokens.mean, wl.output_tokens.mean) == (2, 40, 64, 16)
    for bad, field in [({"listen": "nowhere"}, "listen"), ({"seeds": ["x:99999"]}, "seeds[0]"),
                       ({"mdns": "yes"}, "mdns"), ({"node_key": str(tmp_path / "k")}, "authorized_keys"),
                       ({"busy_poll_ms": -1}, "busy_poll_ms"), ({"busy_poll_ms": 5000}, "busy_poll_ms"),
                       ({"busy_poll_ms": True}, "busy_poll_ms"), ({"id": "x/y"}, "id"), ({"id": ""}, "id"),
                       # the API on the node's own ROUTER or PUB port: it failed at start (exit 1)
                       ({"gateway": {"listen": "127.0.0.1:7700"}}, "gateway.listen"),
                       ({"gateway": {"listen": "0.0.0.0:7701"}}, "gateway.listen"),
                       # a node sends no requests: these were accepted and silently did nothing
                       ({"workload": {"prompts": ["hi"]}}, "workload.prompts: a node file's workload"),
                       ({"workload": {"max_tokens": 8}}, "workload.max_tokens: .*cluster file"),
                       ({"workload": {"temperature": 0}}, "workload.temperature")]:
        p.write_text(yaml.safe_dump({"id": "fog-1", "device": DEV, "listen": "127.0.0.1:7700", **bad}))
        with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
            load_node(p)


def test_cli_bad_cluster_file_exit_2(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(_with(nodes__0__device="toaster-9000")))
    r = run_cli("--plan", str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "c.yaml" in r.stderr and "toaster-9000" in r.stderr


@pytest.mark.parametrize("text", ["1e30", "1.0e30", "1.0e6", "2E3", ".5e3", "1e-6", "-3e2"])
def test_the_number_hint_spells_a_number_yaml_reads_as_one(text):
    """The hint said "write 1.0e30", which PyYAML (YAML 1.1) also reads as the string '1.0e30'."""
    import re

    import yaml

    from meshllm.errors import number_hint

    assert isinstance(yaml.safe_load(f"x: {text}")["x"], str)
    spelled = re.search(r"write (\S+)\)$", number_hint(text)).group(1)
    assert yaml.safe_load(f"x: {spelled}")["x"] == pytest.approx(float(text))


def test_a_device_s_short_name_is_its_commonest_model(tmp_path):
    """`device: raspberry-pi-5`, as people say it, is the 8 GB profile (it was an exit 2)."""
    from meshllm.device import load_device

    assert load_device("raspberry-pi-5") == load_device("raspberry-pi-5-8gb")
    p = tmp_path / "c.yaml"
    p.write_text("model: smollm2-135m\nnodes:\n  - {id: edge-1, device: raspberry-pi-5, zone: edge}\n")
    assert load_cluster(p).nodes[0].device.name == "raspberry-pi-5-8gb"


def test_yaml_too_deep_a_nul_byte_and_a_huge_max_tokens_are_one_line_config_errors(tmp_path):
    """Each was something else: a RecursionError (a runtime error, exit 1), a two-line message,
    and a run whose every request the API refused (max_tokens above its 2**31)."""
    cases = [("nodes: " + "[" * 1000 + "]" * 1000 + "\n", "nested too deeply"),
             ("model: x\x00\n", "special characters are not allowed"),
             ("model: smollm2-135m\nnodes: [{id: a, device: raspberry-pi-5-8gb, zone: z}]\n"
              "workload: {prompts: [hi], max_tokens: 10000000000}\n", "workload.max_tokens")]
    for i, (text, why) in enumerate(cases):
        p = tmp_path / f"c{i}.yaml"
        p.write_text(text)
        with pytest.raises(ConfigError, match=why) as e:
            load_cluster(p)
        assert "\n" not in str(e.value)


def test_cluster_sections_carry_their_values_and_bounds_are_inclusive():
    """The security flags land in their own fields, a length without `dist` is lognormal, the
    bounds themselves (gamma 16, a rate of MIN_RATE) are taken, and the planner's inputs count
    the prompts and leave out a draft that is `none`."""
    from meshllm.config import plan_inputs
    from meshllm.defaults import MIN_RATE

    c = parse_cluster(_with(security={"curve": True}, speculation={"gamma": 16},
                            workload={"prompts": ["a", "b"], "arrival_rate_per_s": MIN_RATE,
                                      "input_tokens": {"mean": 64}}), "c.yaml")
    assert (c.security.curve, c.security.api_token) == (True, False)
    assert c.speculation.gamma == 16 and c.workload.arrival_rate_per_s == MIN_RATE
    assert c.workload.input_tokens.dist == "lognormal"
    inp = plan_inputs(c)
    assert inp.n_prompts == 2 and inp.draft_quant == "w4a16"
    assert plan_inputs(parse_cluster(_with(draft={"quant": "none"}), "c.yaml")).draft_quant is None


def test_host_port_bounds_and_host_names(tmp_path):
    """A node's port is 1..65534 (its PUB socket takes PORT + 1), an HTTP listener's 1..65535 and
    may be a bracketed IPv6 address; a host label neither starts nor ends with '-'."""
    from meshllm.yaml_fields import split_hostport

    assert split_hostport("127.0.0.1:65534", "n.yaml", "listen") == ("127.0.0.1", 65534)
    assert split_hostport("127.0.0.1:65535", "n.yaml", "gateway.listen", 65535) == ("127.0.0.1", 65535)
    assert split_hostport("[::1]:8000", "n.yaml", "gateway.listen", 65535) == ("::1", 8000)
    assert split_hostport("node_1.local:1", "n.yaml", "listen") == ("node_1.local", 1)
    for bad, why in [("127.0.0.1:0", "port in 1..65534"), ("127.0.0.1:65535", "port in 1..65534"),
                     ("-fog:7700", "is not an IPv4 address"), ("fog-:7700", "is not an IPv4 address"),
                     ("a.-b:7700", "is not an IPv4 address"), ("[::1]:7700", "ZeroMQ sockets are IPv4 only")]:
        with pytest.raises(ConfigError, match=why):
            split_hostport(bad, "n.yaml", "listen")
    with pytest.raises(ConfigError, match="port in 1..65535, got"):
        split_hostport("127.0.0.1:0", "n.yaml", "gateway.listen", 65535)


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path):
    """A YAML (or key) file larger than MAX_YAML_BYTES is refused by its size, before it is read."""
    from meshllm.yaml_fields import MAX_YAML_BYTES

    p = tmp_path / "c.yaml"
    with open(p, "wb") as f:
        f.truncate(MAX_YAML_BYTES + 1)  # sparse: no data written
    with pytest.raises(ConfigError, match=rf"{MAX_YAML_BYTES + 1} bytes: too large for a YAML file \(at most 16 MiB\)"):
        load_cluster(p)


def test_more_node_file_fields_are_checked(tmp_path):
    """Each node-file check refuses its own bad value, at the bounds too: a failure timeout equal
    to the heartbeat, a drain past MAX_DRAIN_S, a 15-character or two-word token, a seed `@HOST:PORT`,
    a burst below 1, an empty expected node id, a bad advertise address, a plan_judge that is not a
    bool, a negative settle time, a workload too long for the model's context, a bare `gateway:`, an
    empty weights_cache and a draft group size the model does not split into."""
    p = tmp_path / "n.yaml"
    base = {"id": "fog-1", "device": DEV, "listen": "127.0.0.1:7700"}
    short, spaced, good = tmp_path / "short", tmp_path / "spaced", tmp_path / "good"
    for f, text in [(short, "x" * 15), (spaced, "x" * 10 + " " + "y" * 10), (good, "x" * 16)]:
        f.write_text(text + "\n")
        f.chmod(0o600)
    gw = {"listen": "127.0.0.1:8000"}
    for bad, field in [({"failure_timeout_s": 2, "heartbeat_interval_s": 2}, "failure_timeout_s: must be larger"),
                       ({"gateway": {**gw, "drain_s": 3601}}, "gateway.drain_s: must be at most 3600"),
                       ({"gateway": {**gw, "api_token": str(short)}}, "gateway.api_token: .*at least 16"),
                       ({"gateway": {**gw, "api_token": str(spaced)}}, "gateway.api_token: .*one word"),
                       ({"listen": "0.0.0.0:7700", "gateway": {"listen": "127.0.0.1:7700"}}, "gateway.listen: "),
                       ({"seeds": ["@127.0.0.1:7800"]}, r"seeds\[0\]: expected ID@HOST:PORT"),
                       ({"rate_limit": {"burst": 0.5}}, "rate_limit.burst"),
                       ({"expect_nodes": ["a", ""]}, "expect_nodes: must be a list of node ids"),
                       ({"advertise": "nowhere"}, "advertise: expected HOST:PORT"),
                       ({"plan_judge": "yes"}, "plan_judge: must be true or false"),
                       ({"plan_settle_s": -1}, "plan_settle_s: must be a finite number >= 0"),
                       ({"workload": {"input_tokens": {"mean": 100000}}}, "workload.input_tokens: mean 100000"),
                       ({"gateway": None}, "gateway: is empty"), ({"weights_cache": ""}, "weights_cache: must be a"),
                       ({"draft": {"quant": "w4a16", "group_size": 128}}, "draft.group_size: 128 does not divide")]:
        p.write_text(yaml.safe_dump({**base, **bad}))
        with pytest.raises(ConfigError, match=f"^{p}: {field}"):
            load_node(p)
    p.write_text(yaml.safe_dump({**base, "busy_poll_ms": 1000, "gateway": {**gw, "api_token": str(good)}}))
    n = load_node(p)
    assert n.busy_poll_ms == 1000 and n.api_token == "x" * 16
    p.write_text(yaml.safe_dump({**base, "listen": "*:7700"}))
    with pytest.raises(ConfigError, match="advertise: required when listen binds all interfaces"):
        assert load_node(p).advertise_address
