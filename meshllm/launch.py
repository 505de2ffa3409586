"""The meshllm command line: the only place that reads argv.

Run `python launch.py --help` (or the `meshllm` console script). Modes:

    --node-config NODE.yaml     run one node until SIGINT/SIGTERM
    --cluster CLUSTER.yaml      emulate a whole cluster locally, run its workload, tear down
    --cluster CLUSTER.yaml --serve   emulate it and keep serving the OpenAI API until Ctrl-C
    --cluster CLUSTER.yaml --kill NODE@S --restart NODE@S --pause NODE@S1-S2
                      --partition ZA:ZB@S1-S2   ... with faults
    --cluster CLUSTER.yaml --judge  ... the coordinator plans as --plan --judge does
    --plan CLUSTER.yaml         planner only (--json, --png FILE, --rate R; --judge: the simulator
                                picks among the search's candidates, as --simulate's meshllm does)
    --simulate CLUSTER.yaml     discrete-event simulation with baselines (--json, --rate R)
    --reference                 single-process reference generation (the oracle)
    --status [ID@]HOST:PORT     ask a running node for its view of the mesh (a mesh with CURVE:
                                ID@, $MESHLLM_NODE_KEY and $MESHLLM_AUTHORIZED_KEYS, or $MESHLLM_CLUSTER_KEY)
    --keygen FILE               write a new CURVE secret key (mode 0600), print its public key

Exit codes: 0 success, 2 bad input (one line naming file/field/problem), 1 runtime failure.
With --json exactly one JSON object goes to stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

from meshllm.errors import InputError

MAX_THREADS = 1024  # --threads: more segfaulted torch (100 000) or ran for minutes (5 000)
MAX_TIMEOUT_S = 7 * 86400.0  # --timeout: a week (1e300 overflowed a C long)

log = logging.getLogger("meshllm")


class Parser(argparse.ArgumentParser):
    """argparse, but bad usage is one line too (exit 2), as every other input error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="meshllm", description="Serve an LLM on a ZeroMQ mesh of edge/fog devices.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--node-config", metavar="NODE.yaml", help="run one node until SIGINT/SIGTERM")
    mode.add_argument("--cluster", metavar="CLUSTER.yaml", help="emulate a cluster locally and run its workload")
    mode.add_argument("--plan", metavar="CLUSTER.yaml", help="planner only")
    mode.add_argument("--simulate", metavar="CLUSTER.yaml", help="discrete-event simulation with baselines")
    mode.add_argument("--reference", action="store_true", help="single-process reference generation")
    mode.add_argument("--status", metavar="[ID@]HOST:PORT", help="ask a running node for its view of the mesh "
                      "(with CURVE: ID@HOST:PORT and $MESHLLM_NODE_KEY, $MESHLLM_AUTHORIZED_KEYS; or $MESHLLM_CLUSTER_KEY)")
    mode.add_argument("--keygen", metavar="FILE", help="write a new node key (CURVE secret key, mode 0600) to FILE "
                      "and print its public key for the authorized_keys file")
    p.add_argument("--model", default=None, help="registry name, .gguf file or HF safetensors dir")
    p.add_argument("--draft", default=None, help="reference: run the quantized draft instead (w4a16|w8a16)")
    p.add_argument("--group-size", type=int, default=64, help="draft quantization group size (default 64)")
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate (reference: 48; cluster: the file's workload.max_tokens)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature, 0-2 (0 = greedy; --reference: 0 by default, --cluster: the "
                   "file's workload.temperature)")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus probability mass")
    p.add_argument("--seed", type=int, default=0, help="sampling / planner seed")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target dtype")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--serve", action="store_true", help="cluster: keep serving the HTTP API until Ctrl-C")
    p.add_argument("--kill", action="append", default=None, metavar="NODE@S",
                   help="cluster: kill -9 NODE S seconds after the workload's first request (repeatable)")
    p.add_argument("--restart", action="append", default=None, metavar="NODE@S",
                   help="cluster: kill -9 NODE S seconds after the workload's first request and start it again "
                        "at once from its node file (repeatable)")
    p.add_argument("--pause", action="append", default=None, metavar="NODE@S1-S2",
                   help="cluster: stop NODE (SIGSTOP) from S1 to S2 s after the workload's first request, then "
                        "continue it (repeatable)")
    p.add_argument("--partition", action="append", default=None, metavar="ZA:ZB@S1-S2",
                   help="cluster: drop all traffic between zones ZA and ZB from S1 to S2 s (repeatable)")
    p.add_argument("--png", metavar="FILE", help="plan: draw the plan to FILE")
    p.add_argument("--judge", action="store_true",
                   help="plan, cluster: run the search's candidate plans and the baselines' groupings through "
                        "the simulator and keep the best, as --simulate plans meshllm (seconds to minutes)")
    p.add_argument("--rate", type=float, default=None,
                   help="plan, simulate: override the workload's arrival rate (req/s) the plan is made for")
    p.add_argument("--timeout", type=float, default=None,
                   help="status: seconds to wait for the reply (3); cluster: for the mesh to form (60) and its "
                        "layers to load (at least 300)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


GENERATION = ("reference", "cluster")
# option -> the modes it applies to: given with any other mode it is bad input (exit 2), never
# silently ignored (dest names; "given" = not the parser's default)
APPLIES: dict[str, tuple[str, ...]] = {
    "model": ("reference",), "draft": ("reference",), "group_size": ("reference",), "dtype": ("reference",),
    "threads": ("reference",), "prompt": GENERATION, "max_tokens": GENERATION, "temperature": GENERATION,
    "top_k": GENERATION, "top_p": GENERATION, "chat": GENERATION, "seed": (*GENERATION, "plan", "simulate"),
    "serve": ("cluster",), "kill": ("cluster",), "restart": ("cluster",), "pause": ("cluster",),
    "partition": ("cluster",),
    "judge": ("plan", "cluster"),
    "png": ("plan",), "rate": ("plan", "simulate"), "timeout": ("status", "cluster"),
    "json": ("cluster", "plan", "simulate", "reference", "status", "keygen"),
}
# --cluster --serve takes its requests from the HTTP API: the options of a workload run are not read
NOT_SERVED = ("prompt", "max_tokens", "temperature", "top_k", "top_p", "chat", "seed", "kill", "restart", "pause",
              "partition", "json")
WHY_NOT = {"rate": " (a cluster's load is its workload: arrival_rate_per_s)",
           "model": " (cluster and node files name their model: model:)",
           "draft": " (a cluster file sets draft: {quant, group_size})", "group_size": " (a cluster file's draft:)"}


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_options(p: argparse.ArgumentParser, a: argparse.Namespace, mode: str) -> None:
    """InputError for an option the mode does not use, or a value no run could take (the HTTP
    API's ranges for sampling: the CLI sends them there with --cluster)."""
    from meshllm.defaults import MAX_RATE, MIN_RATE
    from meshllm.mesh.fields import MAX_TEMPERATURE, is_int, is_num

    if getattr(a, mode) == "":
        want = "[ID@]HOST:PORT" if mode == "status" else "a file path"
        raise InputError(f"{flag(mode)}: the argument is empty ({want} expected)")
    if a.model == "":  # it ran the embedded model, as if no --model had been given
        raise InputError("--model: the argument is empty (a registry name, a .gguf file or an HF directory expected)")
    for dest, modes in APPLIES.items():
        if mode not in modes and getattr(a, dest) != p.get_default(dest):
            names = [flag(m) for m in modes]
            listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
            raise InputError(f"{flag(dest)} applies to {listed} only{WHY_NOT.get(dest, '')}; "
                             f"it was given with {flag(mode)}")
    if mode == "cluster" and a.serve:
        for dest in NOT_SERVED:
            if getattr(a, dest) != p.get_default(dest):
                raise InputError(f"{flag(dest)} applies to a --cluster run of a workload; with --serve the mesh takes "
                                 "its requests (and their parameters) from the HTTP API until Ctrl-C")
    if mode == "reference" and a.group_size != p.get_default("group_size") and a.draft is None:
        raise InputError("--group-size applies to --draft (the reference runs the target model unless --draft "
                         "w4a16|w8a16 is given)")
    if mode == "reference" and a.dtype != p.get_default("dtype") and a.draft is not None:
        raise InputError("--dtype applies to the target model; a --draft runs as its quantization builds it, "
                         "as a drafter does")
    checks = [("max_tokens", is_int(a.max_tokens, 1), ">= 1"),
              ("threads", is_int(a.threads, 1) and a.threads <= MAX_THREADS, f"a number of threads in 1..{MAX_THREADS}"),
              ("temperature", is_num(a.temperature, 0.0, MAX_TEMPERATURE), f"in [0, {MAX_TEMPERATURE:g}] (0: greedy)"),
              ("top_k", is_int(a.top_k, 0), ">= 0 (0: all tokens)"),
              ("top_p", is_num(a.top_p, 0.0, 1.0) and a.top_p > 0, "in (0, 1]"),
              ("rate", is_num(a.rate, MIN_RATE, MAX_RATE), f"a number of requests per second in [{MIN_RATE:g}, "
                                                         f"{MAX_RATE:g}]"),
              ("timeout", is_num(a.timeout) and 0 < a.timeout <= MAX_TIMEOUT_S,
               f"a number of seconds in (0, {MAX_TIMEOUT_S:g}]")]
    for dest, ok, want in checks:
        if getattr(a, dest) is not None and not ok:
            raise InputError(f"{flag(dest)} must be {want}, got {getattr(a, dest):g}")
    for prompt in a.prompt or ():
        try:  # bytes of the command line that are not UTF-8 arrive as lone surrogates: no text to tokenize
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"--prompt {prompt.encode('utf-8', 'backslashreplace').decode()[:60]!r}: not valid "
                             "UTF-8 text") from None


def _finite(v):
    """`v` with every non-finite float as None: JSON has no Infinity or NaN (a strict parser refuses them)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def _emit(obj: dict, as_json: bool, text: str | None = None) -> None:
    obj = _finite(obj)
    if as_json:
        sys.stdout.write(json.dumps(obj, allow_nan=False) + "\n")
    else:
        sys.stdout.write((text if text is not None else json.dumps(obj, indent=2, allow_nan=False)) + "\n")
    sys.stdout.flush()


def cmd_reference(a: argparse.Namespace) -> int:
    from meshllm.engine.generate import GenerationOptions, reference_main

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    opts = GenerationOptions(
        max_tokens=48 if a.max_tokens is None else a.max_tokens,
        temperature=a.temperature or 0.0, top_k=a.top_k, top_p=a.top_p, seed=a.seed, chat=a.chat,
    )
    result, text = reference_main(a.model or "smollm2-135m", a.prompt or ["The capital of France is"], opts,
                                  draft=a.draft, group_size=a.group_size, dtype=a.dtype)
    _emit(result, a.json, text)
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    from meshllm.config import load_cluster, plan_inputs
    from meshllm.partition.plan import plan_cluster

    if a.png:  # before the search: with --judge it runs for minutes
        folder = os.path.dirname(os.path.abspath(a.png))
        if not a.png.lower().endswith(".png") or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise InputError(f"--png {a.png}: must be a .png file in a folder that exists and is writable")
    inp = plan_inputs(load_cluster(a.plan))
    if a.rate is not None:  # plan for another load than the file's (its latency is the objective)
        from dataclasses import replace

        inp = replace(inp, rate_per_s=a.rate)
    if a.judge:  # the simulator picks among the search's candidates and the baselines' groupings
        from meshllm.sim.judge import judged_plan

        plan = judged_plan(inp, seed=a.seed, log=True, report=True)
    else:
        plan = plan_cluster(inp, seed=a.seed)
    if a.png:
        from meshllm.partition.draw import draw_plan  # lazy: matplotlib + networkx

        draw_plan(plan, inp, a.png)
    _emit(plan.to_json(), a.json, plan.describe())
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    from meshllm.config import load_cluster, plan_inputs
    from meshllm.partition.plan import check_servable
    from meshllm.sim.sweep import simulate_policies

    inp = plan_inputs(load_cluster(a.simulate))
    check_servable(inp)  # as --plan: exit 2 naming the shortfall, not a report of policies that cannot run
    _emit(simulate_policies(inp, rate=a.rate, seed=a.seed, log=True), a.json)
    return 0


def cmd_node(a: argparse.Namespace) -> int:
    from meshllm.mesh.node import run_node
    from meshllm.node_config import load_node

    return run_node(load_node(a.node_config))


def cmd_cluster(a: argparse.Namespace) -> int:
    from meshllm.cluster_run import run_cluster
    from meshllm.config import load_cluster
    from meshllm.workload import format_report

    result = run_cluster(load_cluster(a.cluster), a)
    if result is None:  # --serve, stopped with Ctrl-C / SIGTERM
        return 0
    _emit(result, a.json, None if a.json else format_report(result))
    failed = result["metrics"].get("failed", 0)
    return 1 if failed else 0


def cmd_status(a: argparse.Namespace) -> int:
    from meshllm.mesh.node import format_status, query_status
    from meshllm.yaml_fields import node_id, split_hostport

    who, at, where = a.status.rpartition("@")
    split_hostport(where, "--status", "[ID@]HOST:PORT")
    if at:
        node_id(who, "--status", "ID")
    st = query_status(a.status, timeout_s=a.timeout or 3.0)
    if at and isinstance(st, dict) and st.get("node") != who:  # without CURVE nothing else checks the id
        raise InputError(f"--status {a.status}: the node at {where} is {st.get('node')!r:.70}, not {who!r}")
    try:
        text = None if a.json else format_status(st)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # another version's node, or not a node
        raise RuntimeError(f"{a.status} answered with a status this version cannot show ({type(e).__name__}: "
                           f"{e}); --json prints it as it came") from None
    _emit(st, a.json, text)
    return 0


def cmd_keygen(a: argparse.Namespace) -> int:
    from meshllm.mesh.keys import generate_key

    public = generate_key(a.keygen)
    _emit({"key_file": a.keygen, "public_key": public}, a.json, public)  # stdout: the key alone, for $(...)
    if not a.json:
        print(f"(wrote the secret key to {a.keygen}; list the node as `NODE_ID {public}` in authorized_keys)",
              file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    handlers = {"node_config": cmd_node, "cluster": cmd_cluster, "plan": cmd_plan, "simulate": cmd_simulate,
                "reference": cmd_reference, "status": cmd_status, "keygen": cmd_keygen}
    mode = next(k for k in handlers if getattr(a, k) not in (None, False))  # "" too: a bad path, said so
    try:
        check_options(p, a, mode)
        return handlers[mode](a)
    except InputError as e:
        print(f"meshllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshllm: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a runtime failure: one line, the traceback only with -v
        if a.verbose or os.environ.get("MESHLLM_DEBUG"):
            log.exception("runtime failure")
        print(f"meshllm: runtime error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
