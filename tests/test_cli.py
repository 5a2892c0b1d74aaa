"""The CLI's cluster and model commands against a real agent process and a real tiny model:
`members`, `status`, `ring` (human and --json; colours only on a terminal), `load` with
progress, `generate`, `chat` (one message and a conversation from stdin), `watch`, and the
exit codes that mean something (1 no agent, 2 bad input, 3 cluster not ready)."""
from __future__ import annotations

import json
import queue
import threading
import time
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import p2pmesh
from tests.agent.harness import AgentProc, ROOT, free_port, make_model, wait_for

pytestmark = pytest.mark.timeout(240)

ANSI = "\x1b["
PROMPT = "the quick brown fox"
READ_COMMANDS = [
    ["status"], ["members"], ["ring"], ["links"], ["watch"], ["generate", "x"], ["chat", "x"], ["load", "m"],
    ["plan", "solve", "s.json"], ["plan", "model", "c.json"], ["ring", "solve", "g.json"], ["local"], ["links", "parse", "--system-profiler", "f"],
    ["service", "status"], ["doctor"],
]


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProc]:
    from p2pmesh.drivers.keys import write_key

    tmp = tmp_path_factory.mktemp("cli")
    write_key(tmp / "key", bytes(range(3, 35)))
    a = AgentProc(tmp / "a", f"127.0.0.41:{free_port()}", key_file=tmp / "key",
                  extra=["--no-mdns", "--data-port", str(random.Random().randrange(30000, 39000))])
    a.state_dir.mkdir()
    a.start()
    try:
        wait_for(lambda: _healthy(a.state_dir), 30, "a one-member cluster")
        yield a
    finally:
        a.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny"
    make_model(out, family="llama", layers=4, hidden=64, seed=5)
    return out


def _healthy(state_dir: Path) -> bool:
    try:
        return p2pmesh.connect(state_dir).status().healthy
    except p2pmesh.AgentNotRunning:
        return False


def cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2pmesh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, input=stdin, env={**os.environ, **(env or {})}, check=False)


def ok(*args: str, **kw: object) -> str:
    r = cli(*args, **kw)  # type: ignore[arg-type]
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_every_read_command_takes_json() -> None:
    from p2pmesh.cli.app import build_parser

    parser = build_parser()
    for argv in READ_COMMANDS:
        assert parser.parse_args([*argv, "--json"]).json is True, argv


def test_every_command_runs_its_own_module() -> None:
    """Each subcommand's `run` default is the run of the p2pmesh/cli module that added it, so
    app.main dispatches every command (and only through the command modules)."""
    import argparse

    from p2pmesh.cli import app

    sub = next(a for a in app.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    runs = {name: sp.get_default("run") for name, sp in sub.choices.items()}
    assert set(runs) == {"agent", "status", "members", "leave", "ring", "doctor", "links", "plan", "local", "service",
                         "load", "model", "generate", "chat", "watch", "pair", "key"}
    for name, run in runs.items():
        module = next((m for m in app.COMMAND_MODULES if m.run is run), None)
        assert module is not None, f"`p2pmesh {name}` dispatches to {run!r}, not to a command module's run"


def test_no_agent_exit_1_and_says_how_to_start_one(tmp_path: Path) -> None:
    for argv in (["status"], ["members"], ["generate", "hi"], ["chat", "hi"], ["load", str(tmp_path)]):
        r = cli(*argv, "--state-dir", str(tmp_path))
        assert r.returncode == 1, (argv, r.stderr)
        assert "p2pmesh agent" in r.stderr and str(tmp_path / "agent.sock") in r.stderr, r.stderr


def test_members_and_status_human_json_and_colour(agent: AgentProc) -> None:
    target = ("--state-dir", str(agent.state_dir))
    members = json.loads(ok("members", "--json", *target))
    assert set(members) == {"leader", "term", "members"} and len(members["members"]) == 1
    me = members["members"][0]["node_id"]
    assert members["leader"] == me
    plain = ok("members", *target)
    assert me[:8] in plain and "leader" in plain and "up" in plain and ANSI not in plain  # a pipe: no colours
    coloured = ok("members", *target, env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert ANSI in coloured and me[:8] in coloured  # a terminal: the same words, with colours
    status = ok("status", *target)
    assert f"node {me[:8]}" in status and "model: none" in status and ANSI not in status
    assert json.loads(ok("status", "--json", *target))["node_id"] == me
    assert json.loads(ok("ring", "--json", *target))["order"] == [me]
    assert "ring epoch" in ok("ring", *target)


def test_not_ready_and_bad_input_exit_codes(agent: AgentProc, tmp_path: Path) -> None:
    target = ("--state-dir", str(agent.state_dir))
    r = cli("generate", PROMPT, *target)
    assert r.returncode == 3 and "load one first" in r.stderr, r.stderr
    r = cli("chat", " ", *target)
    assert r.returncode == 2 and "empty" in r.stderr, r.stderr
    r = cli("watch", "--count", "0", *target)
    assert r.returncode == 2 and "--count" in r.stderr


def test_pair_says_what_is_missing_and_refuses_bad_options(agent: AgentProc) -> None:
    target = ("--state-dir", str(agent.state_dir))
    r = cli("pair", "--timeout", "5", *target)
    assert r.returncode == 1 and "no Thunderbolt cable" in r.stderr, r.stderr
    r = cli("pair", "--join", "--timeout", "5", *target)  # its key comes from --cluster-key-file
    assert r.returncode == 1 and "reads its key from" in r.stderr, r.stderr
    r = cli("pair", "--timeout", "0", *target)
    assert r.returncode == 2 and "--timeout" in r.stderr
    r = cli("pair", "--yes-if-code", "12", *target)
    assert r.returncode == 2 and "six digits" in r.stderr


def test_agent_refuses_a_layer_time_that_is_no_time() -> None:
    for bad in ("0", "-1", "nan", "inf", "1e9", "fast"):
        r = cli("agent", "--layer-ms", bad)
        assert r.returncode == 2 and "--layer-ms" in r.stderr, (bad, r.stderr)


def test_agent_refuses_a_batch_or_queue_out_of_bounds() -> None:
    for option, bad in (("--max-batch", "0"), ("--max-batch", "257"), ("--max-batch", "many"),
                        ("--max-queue", "-1"), ("--max-queue", "4097"), ("--max-queue", "1.5")):
        r = cli("agent", option, bad)
        assert r.returncode == 2 and option in r.stderr, (option, bad, r.stderr)


def test_the_head_worker_gets_the_agents_batch_and_queue(tmp_path: Path) -> None:
    """What `p2pmesh agent --max-batch/--max-queue` set reaches the worker's command line."""
    from p2pmesh.agent.tasks.workers import WorkersConfig, worker_command
    from p2pmesh.core.ids import NodeId
    from p2pmesh.worker import serve

    cmd = worker_command("m", [[0, 2]], 0, "ring", WorkersConfig(NodeId("n0"), tmp_path, 47000, None, 3, 5))
    parsed = serve.build_parser().parse_args(cmd[3:])
    assert (parsed.max_batch, parsed.max_queue, parsed.rank) == (3, 5, 0)
    default = worker_command("m", [[0, 2]], 0, "ring", WorkersConfig(NodeId("n0"), tmp_path, 47000))
    assert serve.build_parser().parse_args(default[3:]).max_batch == serve.DEFAULT_MAX_BATCH
    # The placement's batch (the requests its KV cache is reserved for) caps it, and so does the agent's own option.
    for placed, served in ((2, 2), (8, 3), (1, 1)):
        cmd = worker_command("m", [[0, 2]], 0, "ring", WorkersConfig(NodeId("n0"), tmp_path, 47000, None, 3, 5), placed)
        assert serve.build_parser().parse_args(cmd[3:]).max_batch == served


def test_load_generate_chat_and_watch(agent: AgentProc, model: Path) -> None:
    target = ("--state-dir", str(agent.state_dir))
    lines = [json.loads(line) for line in ok("load", str(model), "--context-tokens", "256", "--json", *target).splitlines()]
    progress, result = lines[:-1], lines[-1]
    assert progress[0]["stage"] == "accepted" and progress[-1]["stage"] == "serving"
    assert all(set(p) == {"model", "stage", "ready", "stages", "epoch", "detail", "transfers"} for p in progress)
    assert result["model"] == str(model) and result["layers"] == 4 and result["stages"][0]["layers"] == [0, 4]

    human = ok("load", str(model), "--context-tokens", "256", *target)  # already serving: says so at once
    assert f"serving {model}: 4 layers on 1 stage" in human and ANSI not in human

    # generate: the human text is the JSON pieces joined, and the same as the client API's.
    events = [json.loads(line) for line in ok("generate", PROMPT, "--max-tokens", "12", "--json", *target).splitlines()]
    done = events[-1]
    assert done["done"] is True and done["tokens"] == 12 and done["text"] == "".join(e["text"] for e in events[:-1])
    assert ok("generate", PROMPT, "--max-tokens", "12", *target) == done["text"] + "\n"
    with p2pmesh.connect(agent.state_dir) as c:
        assert c.generate(PROMPT, max_tokens=12).collect().text == done["text"]
        reply = c.chat([{"role": "user", "content": "hello"}], max_tokens=8).collect().text

    one = json.loads(ok("chat", "hello", "--max-tokens", "8", "--json", *target))
    assert one["role"] == "assistant" and one["content"] == reply and one["tokens"] == 8
    # A conversation from stdin: two replies, the second with the first turn in its prompt.
    turns = [json.loads(line) for line in ok("chat", "--max-tokens", "8", "--json", *target, stdin="hello\nand then?\n").splitlines()]
    assert len(turns) == 2 and turns[0]["content"] == reply
    with p2pmesh.connect(agent.state_dir) as c:
        second = c.chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": reply},
                         {"role": "user", "content": "and then?"}], max_tokens=8).collect().text
    assert turns[1]["content"] == second

    # watch: clearing the model is seen as an event, in JSON. Other events may come first
    # (the head's load report saying the chats above finished), so read until it shows.
    watcher = subprocess.Popen([sys.executable, "-m", "p2pmesh", "watch", "--json", "--count", "8", *target],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue(maxsize=64)
    threading.Thread(target=lambda: [lines.put(line) for line in watcher.stdout], daemon=True).start()
    kinds: list[str] = []
    try:
        wait_for(lambda: watcher.poll() is None, 5, "the watcher")
        time.sleep(1.5)  # let it take its first status
        assert ok("model", "clear", *target).strip() == "asked the cluster to serve no model"
        deadline = time.monotonic() + 30
        while not {"model_changed", "plan_activated"} & set(kinds) and time.monotonic() < deadline:
            try:
                kinds.append(json.loads(lines.get(timeout=max(0.1, deadline - time.monotonic())))["kind"])
            except queue.Empty:
                break
    finally:
        watcher.kill()
        watcher.wait(timeout=5)
    assert {"model_changed", "plan_activated"} & set(kinds), (kinds, watcher.stderr.read())


def test_status_shows_every_macs_fetch_of_its_files() -> None:
    """`p2pmesh status` draws each entry of status `transfers` as one line: who, from where,
    MB done of MB, MB/s and time left (unknown while the rate is)."""
    from rich.console import Console

    from p2pmesh.cli import terminal

    st = {"node_id": "a" * 32, "cluster_id": "c", "role": "leader", "term": 1, "leader": "a" * 32, "healthy": True,
          "members": [], "ring": None, "placement": None, "requests": None,
          "transfers": [{"node_id": "b" * 32, "source": "hub", "bytes_done": 5 * 10**7, "bytes_total": 10**8, "mb_s": 40.0,
                         "eta_s": 1.3},
                        {"node_id": "c" * 32, "source": "peer", "bytes_done": 0, "bytes_total": 10**6, "mb_s": 0.0,
                         "eta_s": None}]}
    con = Console(record=True, width=200)
    con.print(terminal.status_view(st))
    text = con.export_text()
    assert "bbbbbbbb fetching from the hub: 50.0 of 100.0 MB, 40 MB/s, 1 s left" in text
    assert "cccccccc fetching from the other Macs: 0.0 of 1.0 MB, 0 MB/s, time left unknown" in text
